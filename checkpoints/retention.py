"""Which committed checkpoints to delete: keep the last K, plus every Nth step as a milestone.

Pure logic on step numbers, so the promise is easy to test: given only committed (verified)
steps, it never returns the newest one, never a milestone, never one of the last `keep_last`,
and never a step in `protect` (e.g. the one a restore is reading).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Leftovers of unfinished saves (uncommitted steps older than the newest committed one,
# `.tmp-ds3d-*` files, unfinished multipart uploads) are removed once they are this old: long
# enough that no uploader still at work (an outage, a slow store) loses its objects.
DEFAULT_CLEANUP_GRACE_S = 3600.0


def cleanup_grace_s(checkpoint_settings: Any) -> float:
    """`checkpoint.cleanup_grace_s` of a job's settings (trainer/config.py), or the default
    where the settings have no such field (a bare settings object in tests and tools)."""
    value = getattr(checkpoint_settings, "cleanup_grace_s", None)
    return DEFAULT_CLEANUP_GRACE_S if value is None else float(value)


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
