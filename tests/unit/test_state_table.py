"""The job state table: allowed transitions, refusals, and request checks."""

import pytest

from ds3d.daemon.states import (
    ACTION_STATES,
    LIVE,
    TERMINAL,
    TRANSITIONS,
    JobState,
    can_transition,
    check_action,
    check_transition,
)
from ds3d.trainer.errors import StateError
from ds3d.trainer.kinds import EventKind

pytestmark = pytest.mark.timeout(10)

LEGAL = [
    (JobState.PENDING, JobState.STARTING), (JobState.STARTING, JobState.RUNNING),
    (JobState.RUNNING, JobState.PAUSED), (JobState.PAUSED, JobState.RUNNING),
    (JobState.PAUSED, JobState.STARTING), (JobState.RUNNING, JobState.RECOVERING),
    (JobState.RECOVERING, JobState.RUNNING), (JobState.RECOVERING, JobState.RECOVERING),
    # sets, sorted: pytest-xdist needs every worker to collect the same ids in the same order
    *[(s, end) for s in sorted(LIVE, key=str) for end in sorted(TERMINAL, key=str)],
]


@pytest.mark.parametrize("src,dst", LEGAL)
def test_legal_transitions(src, dst):
    assert can_transition(src, dst)
    check_transition("j", src, dst)


@pytest.mark.parametrize("src,dst", [
    (JobState.PENDING, JobState.RUNNING), (JobState.PENDING, JobState.PAUSED),
    (JobState.STOPPED, JobState.RUNNING), (JobState.COMPLETED, JobState.STARTING),
    (JobState.FAILED, JobState.RECOVERING), (JobState.PAUSED, JobState.RECOVERING),
    (JobState.RUNNING, JobState.PENDING), (JobState.RUNNING, JobState.RUNNING),
])
def test_illegal_transitions_raise_state_error(src, dst):
    assert not can_transition(src, dst)
    with pytest.raises(StateError, match=f"from {src.name} to {dst.name}") as e:
        check_transition("j", src, dst)
    assert e.value.grpc_code == "FAILED_PRECONDITION"


def test_terminal_states_have_no_exit():
    for s in TERMINAL:
        assert not TRANSITIONS[s]
        assert not s.live


def test_values_match_proto_enum():
    from ds3d.v1 import control_pb2 as pb

    for s in JobState:
        assert pb.JobState.Value(s.name) == s.value


@pytest.mark.parametrize("action,state,ok", [
    ("pause", JobState.RUNNING, True), ("pause", JobState.PAUSED, False),
    ("pause", JobState.STOPPED, False), ("resume", JobState.PAUSED, True),
    ("resume", JobState.RUNNING, False), ("stop", JobState.PENDING, True),
    ("stop", JobState.COMPLETED, False), ("save", JobState.RUNNING, True),
    ("save", JobState.PAUSED, False), ("rollback", JobState.PAUSED, True),
    ("rollback", JobState.FAILED, False),
])
def test_actions(action, state, ok):
    if ok:
        check_action("j", action, state)
    else:
        with pytest.raises(StateError, match=f"cannot {action} job 'j': it is {state.name}"):
            check_action("j", action, state)


def test_every_action_allows_only_live_states():
    for states in ACTION_STATES.values():
        assert states <= LIVE


def test_pause_of_stopped_job_says_what_to_do():
    with pytest.raises(StateError, match="start a new job"):
        check_action("j", "pause", JobState.STOPPED)


@pytest.mark.parametrize("state", [JobState.STARTING, JobState.RUNNING, JobState.RECOVERING])
def test_resume_while_a_pause_is_under_way_says_to_wait_for_paused(tmp_path, state):
    """Was: `ds3dctl pause JOB && ds3dctl resume JOB` (the README's line) was refused with "it
    is already running", though the job was being paused: pause returns once the request is
    stored, and the workers save and exit after it."""
    from ds3d.daemon.service import JobService
    from ds3d.daemon.store import Store
    from ds3d.trainer.config import build_job_config
    from ds3d.trainer.kinds import EventKind

    store = Store(tmp_path / "ds3d.db")
    store.create_job("j", build_job_config("tiny", name="j").dump_json(), "n1", str(tmp_path))
    way = [JobState.STARTING, JobState.RUNNING, JobState.RECOVERING]
    for s in way[:way.index(state) + 1]:
        store.transition("j", s, "test")
    store.record("j", EventKind.REQUEST, "pause requested", desired_state=JobState.PAUSED)
    service = JobService(store, None, tmp_path / "jobs", "n1")  # type: ignore[arg-type]
    with pytest.raises(StateError) as err:
        service.resume("j")
    message = str(err.value)
    assert "being paused" in message and "already running" not in message, message
    assert "once `ds3dctl status j` shows PAUSED" in message, message


def _paused_job(tmp_path):
    from ds3d.daemon.store import Store
    from ds3d.trainer.config import build_job_config

    store = Store(tmp_path / "ds3d.db")
    store.create_job("j", build_job_config("tiny", name="j").dump_json(), "n1", str(tmp_path))
    for s in (JobState.STARTING, JobState.RUNNING, JobState.PAUSED):
        store.transition("j", s, "test")
    store.record("j", EventKind.REQUEST, "paused", desired_state=JobState.PAUSED)
    return store


def test_resume_after_a_stop_not_yet_applied_is_refused(tmp_path):
    """A hostile-client probe (2026-12-06) saw ResumeJob answer OK after a StopJob of the same
    PAUSED job had been recorded: the resume set the desired state back to RUNNING, so the stop
    a client had asked for would have been undone had a third request not stopped it again."""
    from ds3d.daemon.service import JobService

    store = _paused_job(tmp_path)
    service = JobService(store, _NoSupervisors(), tmp_path / "jobs", "n1")  # type: ignore[arg-type]
    service.stop("j")
    with pytest.raises(StateError, match="being stopped"):
        service.resume("j")
    assert store.get_job("j").desired_state is JobState.STOPPED


def test_concurrent_stop_and_resume_leave_a_stopped_job_or_a_refused_stop(tmp_path):
    """Each control request reads, checks and records under the job's lock: however a stop and
    a resume interleave, the job never ends up wanting to run after a stop was answered OK."""
    import threading

    from ds3d.daemon.service import JobService

    for attempt in range(20):
        store = _paused_job(tmp_path / str(attempt))
        service = JobService(store, _NoSupervisors(), tmp_path / "jobs", "n1")  # type: ignore[arg-type]
        answers: dict[str, object] = {}
        start = threading.Barrier(2)

        def call(what: str, fn, answers=answers, start=start) -> None:
            start.wait()
            try:
                answers[what] = fn("j")
            except StateError as e:
                answers[what] = e

        threads = [threading.Thread(target=call, args=(w, f)) for w, f in
                   (("stop", service.stop), ("resume", service.resume))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not isinstance(answers["stop"], StateError):
            assert store.get_job("j").desired_state is JobState.STOPPED, answers


class _NoSupervisors:
    def poke(self, name: str) -> None:
        pass
