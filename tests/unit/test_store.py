"""The SQLite store: transitions with events in one transaction, offsets with the events derived
from them, and intent that survives a crash between deciding and acting."""

import json
import multiprocessing
import os
import signal

import pytest

from ds3d.daemon.jobdir import JobDir
from ds3d.daemon.reports import ReportTail
from ds3d.daemon.states import JobState
from ds3d.daemon.store import Store
from ds3d.trainer.errors import AlreadyExistsError, NotFoundError, StateError
from ds3d.trainer.report import Reporter

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "ds3d.db")
    yield s
    s.close()


def test_create_get_and_duplicate(store):
    job = store.create_job("a", "{}", "n1", "/x/a")
    assert job.state is JobState.PENDING and job.desired_state is JobState.RUNNING
    with pytest.raises(AlreadyExistsError, match="already exists"):
        store.create_job("a", "{}", "n1", "/x/a")
    with pytest.raises(NotFoundError, match="no job named 'b'"):
        store.get_job("b")
    assert [e.kind for e in store.events(job="a")] == ["state"]


def test_transition_writes_transition_and_event_together(store):
    store.create_job("a", "{}", "n1", "/x/a")
    store.transition("a", JobState.STARTING, "go", agent_pid=0)
    job = store.transition("a", JobState.RUNNING, "training", step=3)
    assert job.state is JobState.RUNNING and job.step == 3 and job.message == "training"
    assert [(f.name, t.name) for f, t, _ in store.transitions("a")] == [
        ("PENDING", "STARTING"), ("STARTING", "RUNNING")]
    ev = store.events(job="a", kinds=["state"])[-1]
    assert (ev.from_state, ev.to_state) == (JobState.STARTING.value, JobState.RUNNING.value)


def test_an_ended_job_wants_nothing_more(store):
    """A job that ended (COMPLETED, FAILED, STOPPED) shows its end as its desired state too:
    GetJob's "desired RUNNING" for a COMPLETED job read as if the daemon still drove it."""
    for name, end in (("c", JobState.COMPLETED), ("f", JobState.FAILED),
                      ("s", JobState.STOPPED)):
        store.create_job(name, "{}", "n1", f"/x/{name}")
        store.transition(name, JobState.STARTING, "go")
        store.transition(name, JobState.RUNNING, "training")
        assert store.get_job(name).desired_state is JobState.RUNNING
        job = store.transition(name, end, "ended")
        assert (job.state, job.desired_state) == (end, end)


def test_record_sets_the_status_line_with_its_event_or_neither(store):
    """DiskWatch stores a diagnosis and the status line that repeats it in one call: both land
    together, and a record that fails stores neither (no status without its event, no event
    kept to be written again beside a status that failed)."""
    store.create_job("a", "{}", "n1", "/x/a")
    job = store.record("a", "diagnosis", "disk full: /x", status="disk full: /x", cause="disk_full")
    assert job.message == "disk full: /x"
    assert [e.message for e in store.events(job="a", kinds=["diagnosis"])] == ["disk full: /x"]
    with pytest.raises(ValueError):
        store.record("a", "diagnosis", "second", status="second", no_such_column=1)
    assert store.get_job("a").message == "disk full: /x"
    assert len(store.events(job="a", kinds=["diagnosis"])) == 1


def test_illegal_transition_changes_nothing(store):
    store.create_job("a", "{}", "n1", "/x/a")
    before = store.events(job="a")
    with pytest.raises(StateError):
        store.transition("a", JobState.PAUSED, "no")
    assert store.get_job("a").state is JobState.PENDING
    assert store.events(job="a") == before
    assert store.transitions("a") == []


def test_unknown_column_is_refused_and_rolled_back(store):
    store.create_job("a", "{}", "n1", "/x/a")
    with pytest.raises(ValueError):
        store.transition("a", JobState.STARTING, "x", state=9)
    assert store.get_job("a").state is JobState.PENDING


def test_ingest_is_atomic_with_offsets(store, tmp_path):
    store.create_job("a", "{}", "n1", "/x/a")
    jd = JobDir(tmp_path / "jobs", "a")
    jd.create("{}")
    rep = Reporter(jd.path, rank=0, restart=0)
    rep.emit("start", step=0, world_size=1)
    for s in (1, 2):
        rep.emit("step", step=s, loss=5.0 - s, tokens_per_s=100.0, step_time_s=0.1)
        rep.emit("heartbeat", step=s, phase="train")
    rep.emit("checkpoint", step=2, phase="saved", path=str(jd.ckpt / "s2"), blocked_s=0.5)
    tail = ReportTail(store, jd)
    obs = tail.poll()
    assert len(obs.records) == 6
    job = store.get_job("a")
    assert (job.step, job.loss, job.last_ckpt_step) == (2, 3.0, 2)
    kinds = [e.kind for e in store.events(job="a")]
    assert kinds.count("step") == 2 and "heartbeat" not in kinds
    assert [c.step for c in store.checkpoints("a")] == [2]
    # a second poll (or a new daemon with a fresh tail) derives nothing twice
    assert ReportTail(store, jd).poll().records == []
    rep.emit("done", step=2, reason="completed")
    rep.close()
    assert len(ReportTail(store, jd).poll().records) == 1
    assert store.get_job("a").done_reason == "completed"
    assert [e.kind for e in store.events(job="a")].count("step") == 2


def test_torn_last_line_waits_for_its_newline(store, tmp_path):
    store.create_job("a", "{}", "n1", "/x/a")
    jd = JobDir(tmp_path / "jobs", "a")
    jd.create("{}")
    path = jd.reports / "rank-00000.jsonl"
    path.write_text(json.dumps({"kind": "step", "step": 1, "rank": 0, "loss": 1.0}) + "\n"
                    + '{"kind": "step", "st')
    tail = ReportTail(store, jd)
    assert len(tail.poll().records) == 1
    with open(path, "a") as fh:
        fh.write('ep": 2, "rank": 0, "loss": 0.5}\n')
    assert [r["step"] for r in tail.poll().records] == [2]


def _record_intent_then_die(db_path: str) -> None:
    s = Store(db_path)
    s.record("a", "command", "pause requested", desired_state=JobState.PAUSED, command_id=1,
             command_action="pause")
    os.kill(os.getpid(), signal.SIGKILL)  # crash before the command file is written


def test_intent_survives_a_crash_before_the_action(store, tmp_path):
    """The daemon records "pause" and dies before writing the command file: the intent is
    there after the restart, and the supervisor's delivery rule writes the command then."""
    store.create_job("a", "{}", "n1", "/x/a")
    store.transition("a", JobState.STARTING, "go")
    store.transition("a", JobState.RUNNING, "training")
    p = multiprocessing.get_context("fork").Process(target=_record_intent_then_die,
                                                    args=(str(store.path),))
    p.start()
    p.join(20)
    assert p.exitcode == -signal.SIGKILL
    fresh = Store(store.path)
    job = fresh.get_job("a")
    assert job.desired_state is JobState.PAUSED
    assert (job.command_id, job.command_action, job.command_acked) == (1, "pause", 0)
    assert fresh.events(job="a")[-1].message == "pause requested"
    fresh.close()


def test_crash_inside_a_transaction_leaves_no_half(store, tmp_path):
    store.create_job("a", "{}", "n1", "/x/a")

    def die_mid_tx(db_path: str) -> None:
        s = Store(db_path)
        with s._tx() as db:  # noqa: SLF001 - simulating a crash inside the store's transaction
            db.execute("INSERT INTO events (job, time, kind) VALUES ('a', 0, 'half')")
            os.kill(os.getpid(), signal.SIGKILL)

    p = multiprocessing.get_context("fork").Process(target=die_mid_tx, args=(str(store.path),))
    p.start()
    p.join(20)
    fresh = Store(store.path)
    assert "half" not in [e.kind for e in fresh.events(job="a")]
    fresh.close()


def test_events_filter_and_order(store):
    store.create_job("a", "{}", "n", "/a")
    store.create_job("b", "{}", "n", "/b")
    store.record("a", "command", "x")
    evs = store.events()
    assert [e.seq for e in evs] == sorted(e.seq for e in evs)
    assert {e.job for e in store.events(job="b")} == {"b"}
    assert [e.kind for e in store.events(job="a", kinds=["command"])] == ["command"]
    assert store.events(after_seq=evs[-1].seq) == []


@pytest.mark.parametrize("content", [b"garbage, not sqlite\n" * 10,
                                     b"SQLite format 3\x00" + b"\xff" * 200])
def test_a_state_database_that_is_not_one_is_a_clear_refusal(tmp_path, content):
    """Was: sqlite3.DatabaseError 'file is not a database' as a traceback from ds3dd's start."""
    db = tmp_path / "ds3d.db"
    db.write_bytes(content)
    with pytest.raises(StateError) as err:
        Store(db)
    msg = str(err.value)
    assert f"the state database {db} cannot be used" in msg and "move it aside" in msg, msg
    assert db.read_bytes() == content  # left as it was
