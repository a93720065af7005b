"""The job state machine: one enum and one table of allowed transitions.

Every state change in ds3d goes through `check_transition`, and every user request is checked
against `ACTION_STATES` before anything is written or done, so "pause a STOPPED job" is refused
from the same table that the supervisor obeys (StateError -> FAILED_PRECONDITION).

    PENDING -> STARTING -> RUNNING <-> PAUSED
    RUNNING -> RECOVERING -> RUNNING
    RECOVERING -> RECOVERING      (the relaunch failed too: the next restart, under the budget)
    PAUSED -> STARTING            (resume: workers start again and load the newest checkpoint)
    STARTING | RECOVERING -> PAUSED   (a pause accepted while RUNNING that lands during a restart)
    any live state -> COMPLETED | FAILED | STOPPED

Departure from the sketch in DESIGN.md: resume goes PAUSED -> STARTING -> RUNNING (not straight
to RUNNING), so the state tells the truth while the workers initialise, which takes tens of
seconds.
"""

from __future__ import annotations

import enum

from ds3d.trainer.errors import StateError


class JobState(enum.Enum):
    """Values equal the proto enum numbers (ds3d.v1.JobState), so conversion is `JobState(n)`."""

    PENDING = 1
    STARTING = 2
    RUNNING = 3
    PAUSED = 4
    RECOVERING = 5
    COMPLETED = 6
    FAILED = 7
    STOPPED = 8

    @property
    def live(self) -> bool:
        return self not in TERMINAL

    def __str__(self) -> str:
        return self.name


TERMINAL = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.STOPPED})
LIVE = frozenset(JobState) - TERMINAL

_ENDINGS = {JobState.COMPLETED, JobState.FAILED, JobState.STOPPED}

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.STARTING, *_ENDINGS}),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.PAUSED,
                                  *_ENDINGS}),
    JobState.RUNNING: frozenset({JobState.PAUSED, JobState.RECOVERING, *_ENDINGS}),
    JobState.PAUSED: frozenset({JobState.RUNNING, JobState.STARTING, *_ENDINGS}),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.RECOVERING, JobState.PAUSED,
                                    *_ENDINGS}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.STOPPED: frozenset(),
}

# User requests and the states in which each is accepted.
ACTION_STATES: dict[str, frozenset[JobState]] = {
    "pause": frozenset({JobState.RUNNING}),
    "resume": frozenset({JobState.PAUSED}),
    "stop": LIVE,
    "save": frozenset({JobState.RUNNING}),
    "rollback": frozenset({JobState.RUNNING, JobState.PAUSED}),
    "inject": frozenset({JobState.STARTING, JobState.RUNNING, JobState.RECOVERING}),
}


def can_transition(src: JobState, dst: JobState) -> bool:
    return dst in TRANSITIONS[src]


def check_transition(job: str, src: JobState, dst: JobState) -> None:
    """Raises StateError unless `src -> dst` is in the table."""
    if not can_transition(src, dst):
        allowed = ", ".join(sorted(s.name for s in TRANSITIONS[src])) or "none (terminal)"
        raise StateError(f"job {job!r}: cannot go from {src.name} to {dst.name}; "
                         f"allowed from {src.name}: {allowed}")


def check_action(job: str, action: str, state: JobState) -> None:
    """Raises StateError, naming the states where `action` would be accepted."""
    allowed = ACTION_STATES[action]
    if state not in allowed:
        hint = ""
        if state in TERMINAL:
            hint = "; the job has ended — start a new job under another name"
        elif action == "pause" and state is JobState.PAUSED:
            hint = "; it is already paused"
        elif action == "resume" and state in {JobState.RUNNING, JobState.STARTING}:
            hint = "; it is already running"
        raise StateError(f"cannot {action} job {job!r}: it is {state.name}, and {action} is "
                         f"accepted only when it is "
                         f"{' or '.join(sorted(s.name for s in allowed))}{hint}")
