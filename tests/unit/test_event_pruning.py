"""The event table is bounded: a job keeps its newest `events_kept` step and checkpoint events
of each kind (pruned every `prune_every` of them), never loses a fault, state, recovery or
other history event, and paging by sequence number still reads every event kept, in order."""

import pytest

from ds3d.daemon import main as ds3dd_main
from ds3d.daemon.store import EVENTS_KEPT, PRUNED_KINDS, Store
from ds3d.trainer.kinds import EventKind

pytestmark = pytest.mark.timeout(60)

KEPT, EVERY = 50, 10


def _soak(store: Store, job: str, steps: int) -> None:
    """What a soak's report tail stores: a step event a step, a checkpoint event most steps and
    a fault with its recovery now and then (about the soak's 2.5 rows a step)."""
    for s in range(1, steps + 1):
        events = [{"time": float(s), "kind": "step", "step": s, "rank": 0, "loss": 1.0 / s}]
        if s % 5:
            events.append({"time": float(s), "kind": "checkpoint", "step": s, "rank": 0,
                           "message": f"checkpoint step {s} saved"})
        if s % 97 == 0:
            events += [{"time": float(s), "kind": "fault", "step": s, "cause": "nan"},
                       {"time": float(s), "kind": "recovery", "step": s, "cause": "nan"}]
        store.ingest(job, {"rank-00000.jsonl": s * 100}, events, step=s)


def _steps(store: Store, job: str, kind: str = "step") -> list[int]:
    return [e.step for e in store.events(job=job, kinds=[kind], limit=1 << 20)]


def test_step_and_checkpoint_events_are_bounded_and_history_is_kept(tmp_path):
    store = Store(tmp_path / "db.sqlite", events_kept=KEPT, prune_every=EVERY)
    store.create_job("a", "{}", "n1", "/x/a")
    store.create_job("b", "{}", "n1", "/x/b")
    _soak(store, "b", 20)
    _soak(store, "a", 1000)
    steps = _steps(store, "a")
    assert KEPT <= len(steps) < KEPT + EVERY  # bounded, never below what is promised
    assert steps == list(range(1001 - len(steps), 1001))  # the newest, in order, no gap
    ckpts = _steps(store, "a", "checkpoint")
    assert KEPT <= len(ckpts) < KEPT + EVERY and ckpts[-1] == 999
    # the job's history: every fault, recovery and state event, from the very first
    assert _steps(store, "a", "fault") == list(range(97, 1001, 97))
    assert _steps(store, "a", "recovery") == list(range(97, 1001, 97))
    assert [e.kind for e in store.events(job="a", kinds=["state"])] == ["state"]
    assert store.count_events("a", EventKind.FAULT) == 10
    # another job's events are its own: not pruned by a's
    assert _steps(store, "b") == list(range(1, 21))
    store.close()


def test_paging_by_seq_reads_every_kept_event_once_in_order(tmp_path):
    store = Store(tmp_path / "db.sqlite", events_kept=KEPT, prune_every=EVERY)
    store.create_job("a", "{}", "n1", "/x/a")
    _soak(store, "a", 300)
    every = store.events(job="a", limit=1 << 20)
    paged, after = [], 0
    while batch := store.events(job="a", after_seq=after, limit=7):
        paged += batch
        after = batch[-1].seq
    assert [e.seq for e in paged] == [e.seq for e in every]
    assert all(x.seq < y.seq for x, y in zip(paged, paged[1:], strict=False))
    # a follower that had read up to some seq before a pruning goes on from there
    last = paged[-1].seq
    more = [{"time": 1e6, "kind": "step", "step": 301, "rank": 0}]
    store.ingest("a", {}, more)
    assert [e.step for e in store.events(job="a", after_seq=last)] == [301]
    store.close()


def test_a_restarted_daemon_keeps_the_bound(tmp_path):
    """The count since the last pruning lives in memory: after a restart the bound holds again
    within one more batch."""
    store = Store(tmp_path / "db.sqlite", events_kept=KEPT, prune_every=EVERY)
    store.create_job("a", "{}", "n1", "/x/a")
    _soak(store, "a", 200)
    store.close()
    store = Store(tmp_path / "db.sqlite", events_kept=KEPT, prune_every=EVERY)
    for s in range(201, 211):
        store.ingest("a", {}, [{"time": float(s), "kind": "step", "step": s, "rank": 0}])
    steps = _steps(store, "a")
    assert KEPT <= len(steps) < KEPT + EVERY and steps[-1] == 210
    store.close()


def test_the_events_kept_flag_is_checked_and_reaches_the_store(tmp_path, capsys):
    assert ds3dd_main.build_parser().parse_args([]).events_kept == EVENTS_KEPT
    assert ds3dd_main.build_parser().parse_args(["--events-kept", "5000"]).events_kept == 5000
    for bad in ("10", "1e5", "-1"):
        with pytest.raises(SystemExit) as exc:
            ds3dd_main.main(["--state-dir", str(tmp_path / "s"), "--events-kept", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"--events-kept: {bad!r} is not a whole number of events from 1000" in err
    assert set(PRUNED_KINDS) == {EventKind.STEP, EventKind.CHECKPOINT}
    with pytest.raises(ValueError, match="at least 1"):
        Store(tmp_path / "db.sqlite", events_kept=0)
