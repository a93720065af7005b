"""The supervisor's decision table: which handler a job gets for its (state, requested state),
and what the workers' `done` reason means.

Like torch elastic's agent loop (`_invoke_run`: one branch per `WorkerState`), each tick of a
job's supervisor (daemon/supervisor.py) picks one small handler from the job's state and the
state requested of it (`Job.desired_state`, written by the service), so the whole policy can be
read here:

    requested   state                         handler
    PAUSED      any                           WIND_DOWN  deliver the command, end in PAUSED/STOPPED
    STOPPED     any                           WIND_DOWN
    RUNNING     any, a rollback requested     ROLLBACK   kill the workers, restart from step N
    RUNNING     PENDING, PAUSED               START      -> STARTING (resume: newest checkpoint)
    RUNNING     STARTING, RECOVERING          BRING_UP   launch when due, then SUPERVISE
    RUNNING     RUNNING (and any other)       SUPERVISE  deliver commands, end on `done`, faults

Every transition a handler makes is still checked by the table in daemon/states.py.
"""

from __future__ import annotations

import enum

from ds3d.trainer.kinds import DoneReason

from .states import JobState


class Handler(enum.Enum):
    """One supervisor handler (daemon/supervisor.py `JobSupervisor._handlers`)."""

    WIND_DOWN = "wind_down"
    ROLLBACK = "rollback"
    START = "start"
    BRING_UP = "bring_up"
    SUPERVISE = "supervise"


_BY_STATE_WHEN_RUNNING = {
    JobState.PENDING: Handler.START,
    JobState.PAUSED: Handler.START,
    JobState.STARTING: Handler.BRING_UP,
    JobState.RECOVERING: Handler.BRING_UP,
}


def handler_for(state: JobState, requested: JobState, rollback_requested: bool) -> Handler:
    """The handler of one tick. A pause or stop wins over a pending rollback (the service
    accepts a stop at any time); a rollback wins over everything else."""
    if requested in (JobState.PAUSED, JobState.STOPPED):
        return Handler.WIND_DOWN
    if rollback_requested:
        return Handler.ROLLBACK
    return _BY_STATE_WHEN_RUNNING.get(state, Handler.SUPERVISE)


def done_reason(stored: str) -> DoneReason | None:
    """The reason of a stored `Job.done_reason`; None for "" and for one the trainer does
    not write (which ends the job FAILED)."""
    try:
        return DoneReason(stored)
    except ValueError:
        return None


# the reasons that end the job; REPARTITION and RESTART are planned restarts
END_STATES: dict[DoneReason, JobState] = {
    DoneReason.COMPLETED: JobState.COMPLETED,
    DoneReason.PAUSED: JobState.PAUSED,
    DoneReason.STOPPED: JobState.STOPPED,
}
