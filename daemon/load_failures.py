"""Checkpoints that pass every check and still cannot be loaded.

A checkpoint whose files all verify can still fail inside DeepSpeed's load: a writer's bug, a key
or shape the model does not have. Restarting the worker group loads the same newest checkpoint
and fails the same way until the restart budget is spent and the job FAILS, where nobody can
`ds3dctl rollback` it any more. The workers report such a failure (a `checkpoint` record, phase
`load_failed`, trainer/load_failure.py; a lost peer, memory or a disk error is not one); this
detector turns a step whose load failed in two worker groups into a fault that rolls back past
it: the supervisor restarts from the newest committed checkpoint before it (a rollback, which
deletes the unloadable step with the abandoned timeline).

A checkpoint that DeepSpeed's converter refuses when the layout changed (a lost node: phase
`load_failed`, cause `reshape`, checkpoints/engine_io.py) is not rolled back past: every older
checkpoint needs the same conversion. The job is PAUSED at once (after two groups), everything
kept, until the layout it was saved with is back or the cause is fixed.

Only one step back by itself: when the checkpoint it rolled back to fails to load as well, the
cause is likelier the environment (a DeepSpeed version, the configuration, the disk) than two
checkpoints, and walking further back would delete good ones. The job is then PAUSED with every
checkpoint kept, the message naming both failures and the ways out.
"""

from __future__ import annotations

from typing import Any

from ds3d.trainer.kinds import EventKind, RecordKind

from .detectors import Fault
from .reports import Observation
from .store import Job, Store

CAUSE = "checkpoint_unloadable"


class UnloadableCheckpoints:
    """A `Detector`: the newest step whose load failed in `groups` worker groups."""

    def __init__(self, store: Store, job: str, groups: int = 2) -> None:
        self.store, self.job, self.groups = store, job, groups
        # step -> {(daemon attempt, agent restart): "rank R: error"} of its failed loads
        self.failed: dict[int, dict[tuple[int, int], str]] = {}
        self.reshape: dict[int, str] = {}  # step -> the layout change its conversion failed

    def check(self, job: Job, obs: Observation, agent_exit: int | None) -> Fault | None:
        for rec in obs.kinds(RecordKind.CHECKPOINT):
            step = rec.get("step")
            if rec.get("phase") != "load_failed" or not isinstance(step, int):
                continue
            group = (job.attempt, int(rec.get("restart", 0)))
            self.failed.setdefault(step, {}).setdefault(
                group, f"rank {rec.get('rank', '?')}: {rec.get('detail', '')}")
            if rec.get("cause") == "reshape":
                self.reshape[step] = str(rec.get("reshape", "?"))
        for step in sorted(self.failed, reverse=True):
            if len(self.failed[step]) >= self.groups:
                errors = list(self.failed.pop(step).values())
                return self._fault(step, errors, self.reshape.pop(step, None))
        return None

    def _fault(self, step: int, errors: list[str], reshape: str | None) -> Fault:
        detail: dict[str, Any] = {"unloadable_step": step, "errors": errors}
        if reshape is not None:
            detail["reshape"] = reshape
            return Fault(CAUSE, f"checkpoint step {step} could not be converted to this layout "
                                f"({reshape}) by {len(errors)} worker groups: {errors[-1]}",
                         restart=False, step=step, detail=detail, roll_back_before=step)
        message = (f"checkpoint step {step} could not be loaded by {len(errors)} worker groups "
                   f"(its files verified): {errors[-1]}")
        after = self.rolled_back_here(step)
        if after is not None:
            detail["rolled_back_from"] = after
            message += (f"; it is the checkpoint the job rolled back to after step {after} "
                        "could not be loaded either")
        return Fault(CAUSE, message, restart=False, step=step, detail=detail,
                     roll_back_before=step)

    def rolled_back_here(self, step: int) -> int | None:
        """The unloadable step whose automatic rollback chose `step`, if one did."""
        for ev in reversed(self.store.events(job=self.job, kinds=[EventKind.FAULT], cause=CAUSE)):
            if ev.detail.get("rollback_to") == step:
                return int(ev.detail.get("unloadable_step", -1))
        return None
