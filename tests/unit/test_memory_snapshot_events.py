"""Memory-only snapshots in the daemon's store: rank 0 reports every one (`checkpoint` record,
phase `held_in_memory`), possibly every few steps for weeks. Only the first of each worker
group becomes an event; every one sets the job's `memory_snapshot_step`, which status shows.

Real report files written by the trainer's Reporter, tailed by the daemon's ReportTail into a
real Store, as under ds3dd."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds3d.daemon.api import job_to_proto
from ds3d.daemon.cli import job_dict
from ds3d.daemon.jobdir import JobDir
from ds3d.daemon.reports import ReportTail
from ds3d.daemon.store import Store
from ds3d.trainer.kinds import RecordKind
from ds3d.trainer.report import Reporter

pytestmark = pytest.mark.timeout(60)


def _held_events(store: Store) -> list[tuple[int, int]]:
    """(step, restart) of the stored held_in_memory events."""
    return [(e.step, e.restart) for e in store.events(job="j", kinds=[RecordKind.CHECKPOINT])
            if e.detail.get("phase") == "held_in_memory"]


def _group(jd: JobDir, restart: int, first_step: int) -> Reporter:
    """A (re)started worker group's rank 0: its reporter and its `start` record."""
    rep = Reporter(jd.path, 0, restart)
    rep.emit(RecordKind.START, step=first_step, world_size=1)
    return rep


def _hold(rep: Reporter, *steps: int) -> None:
    for step in steps:
        rep.emit(RecordKind.STEP, step=step, loss=1.0, tokens_per_s=10.0, step_time_s=0.1)
        rep.emit(RecordKind.CHECKPOINT, step=step, phase="held_in_memory", blocked_s=0.01)


def test_one_event_per_worker_group_and_the_newest_step_in_status(tmp_path: Path) -> None:
    store = Store(tmp_path / "ds3d.db")
    jd = JobDir(tmp_path / "jobs", "j")
    jd.create("{}")
    store.create_job("j", "{}", "n1", str(jd.path))
    tail = ReportTail(store, jd)
    assert store.get_job("j").memory_snapshot_step == -1  # none yet

    rep = _group(jd, 0, 0)
    _hold(rep, 2, 4)
    tail.poll()
    _hold(rep, 6)
    rep.emit(RecordKind.CHECKPOINT, step=8, phase="saved", blocked_s=0.02)
    _hold(rep, 10, 12, 14)
    tail.poll()
    assert _held_events(store) == [(2, 0)]  # was: one event per snapshot, 6 of them
    assert store.get_job("j").memory_snapshot_step == 14
    assert [e.step for e in store.events(job="j", kinds=[RecordKind.STEP])] == \
        [2, 4, 6, 10, 12, 14]  # the other records are stored as before
    rep.close()

    rep = _group(jd, 1, 8)  # a crash: the restarted group resumed at step 8
    _hold(rep, 10, 12)
    tail.poll()
    assert _held_events(store) == [(2, 0), (10, 1)]
    assert store.get_job("j").memory_snapshot_step == 12
    status = job_to_proto(store.get_job("j"))
    assert status.memory_snapshot_step == 12 and job_dict(status)["memory_snapshot_step"] == 12

    _hold(rep, 14, 16)
    ReportTail(store, jd).poll()  # a restarted daemon: the next one is told again, once
    _hold(rep, 18)
    tail2 = ReportTail(store, jd)
    tail2.poll()
    _hold(rep, 20)
    tail2.poll()
    assert _held_events(store) == [(2, 0), (10, 1), (14, 1), (18, 1)]
    assert store.get_job("j").memory_snapshot_step == 20
    rep.close()
    store.close()
