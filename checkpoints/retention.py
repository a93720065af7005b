"""Which committed checkpoints to delete: keep the last K, plus every Nth step as a milestone.

Pure logic on step numbers, so the promise is easy to test: given only committed (verified)
steps, it never returns the newest one, never a milestone, never one of the last `keep_last`,
and never a step in `protect` (e.g. the one a restore is reading).
"""

from __future__ import annotations

from collections.abc import Iterable


def plan_retention(committed_steps: Iterable[int], keep_last: int, keep_every: int = 0,
                   protect: Iterable[int] = ()) -> list[int]:
    """Steps to delete, ascending. `keep_every=0` means no milestones."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest checkpoint is always kept), "
                         f"got {keep_last}")
    if keep_every < 0:
        raise ValueError(f"keep_every must be >= 0, got {keep_every}")
    steps = sorted(set(committed_steps))
    keep = set(steps[-keep_last:]) | set(protect)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]
