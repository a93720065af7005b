"""The supervisor's decision table (daemon/decisions.py): which handler each (state, requested
state) gets, and what each done reason means. The integration tests (daemon lifecycle, e2e,
measured partition) run the handlers themselves on real workers."""

import pytest

from ds3d.daemon.decisions import END_STATES, Handler, done_reason, handler_for
from ds3d.daemon.states import JobState
from ds3d.trainer.kinds import DoneReason


@pytest.mark.parametrize("state", list(JobState))
@pytest.mark.parametrize("requested", [JobState.PAUSED, JobState.STOPPED])
@pytest.mark.parametrize("rollback", [False, True])
def test_a_pause_or_stop_request_winds_down_from_any_state(state, requested, rollback):
    assert handler_for(state, requested, rollback) is Handler.WIND_DOWN


@pytest.mark.parametrize("state", list(JobState))
def test_a_rollback_comes_first_while_the_job_should_run(state):
    assert handler_for(state, JobState.RUNNING, True) is Handler.ROLLBACK


@pytest.mark.parametrize("state,handler", [
    (JobState.PENDING, Handler.START), (JobState.PAUSED, Handler.START),
    (JobState.STARTING, Handler.BRING_UP), (JobState.RECOVERING, Handler.BRING_UP),
    (JobState.RUNNING, Handler.SUPERVISE), (JobState.COMPLETED, Handler.SUPERVISE),
    (JobState.FAILED, Handler.SUPERVISE), (JobState.STOPPED, Handler.SUPERVISE)])
def test_to_run_each_state_has_its_handler(state, handler):
    assert handler_for(state, JobState.RUNNING, False) is handler


def test_done_reasons_end_the_job_or_restart_it():
    assert {r: END_STATES.get(r) for r in DoneReason} == {
        DoneReason.COMPLETED: JobState.COMPLETED, DoneReason.PAUSED: JobState.PAUSED,
        DoneReason.STOPPED: JobState.STOPPED,
        DoneReason.REPARTITION: None, DoneReason.RESTART: None}  # planned restarts


@pytest.mark.parametrize("stored", ["", "crashed", "Completed"])
def test_a_reason_the_trainer_does_not_write_is_none(stored):
    assert done_reason(stored) is None


def test_every_reason_the_trainer_writes_is_read_back():
    assert [done_reason(r.value) for r in DoneReason] == list(DoneReason)
