"""The daemon's checkpoint index (daemon/store.py rows, daemon/ckpt_index.py reconciliation)
against a real file store written by the real upload/commit code."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from ds3d.checkpoints import layout
from ds3d.checkpoints.identity import claim_prefix, new_job_id
from ds3d.checkpoints.storage import Storage, open_storage
from ds3d.checkpoints.upload import commit_checkpoint, upload_rank_files
from ds3d.daemon.ckpt_index import reconcile
from ds3d.daemon.metrics import Metrics
from ds3d.daemon.store import Store
from ds3d.trainer.config import build_job_config

from fixtures.ckpt import meta_for, write_fake_checkpoint


def make_job(tmp_path: Path, keep_last: int = 3) -> tuple[Store, Storage, str]:
    store = Store(tmp_path / "ds3d.db")
    cfg = build_job_config("tiny", name="idx")
    cfg.checkpoint.store = f"file://{tmp_path}/store"
    cfg.checkpoint.keep_last = keep_last
    job_id = new_job_id()
    store.create_job("idx", cfg.dump_json(), "n", str(tmp_path / "run"), job_id=job_id)
    storage = open_storage(f"file://{tmp_path}/store/idx")
    claim_prefix(storage, job_id, "idx")
    return store, storage, job_id


def commit(storage: Storage, local: Path, step: int, job_id: str) -> None:
    files = write_fake_checkpoint(local, step)[0]
    upload_rank_files(storage, step, 0, local, files, job_id=job_id)
    commit_checkpoint(storage, step, 1, meta_for(step, job="idx").model_copy(
        update={"job_id": job_id}), timeout=5)


def ingest(store: Store, *rows: tuple[int, str]) -> None:
    store.ingest("idx", {}, [], [{"step": s, "phase": p, "time": time.time(),
                                  "detail": f"{p} detail"} for s, p in rows])


def phases(store: Store) -> dict[int, str]:
    return {r.step: r.phase for r in store.checkpoints("idx")}


def test_an_older_state_file_gets_the_new_columns(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "ds3d.db")
    db.executescript("CREATE TABLE checkpoints (job TEXT NOT NULL, step INTEGER NOT NULL, "
                     "phase TEXT NOT NULL, path TEXT NOT NULL, time REAL NOT NULL, blocked_s "
                     "REAL NOT NULL DEFAULT 0, PRIMARY KEY (job, step));")
    db.close()
    store = Store(tmp_path / "ds3d.db")
    cols = {r[1] for r in store._db.execute("PRAGMA table_info(checkpoints)")}
    assert "detail" in cols
    assert "job_id" in {r[1] for r in store._db.execute("PRAGMA table_info(jobs)")}


def test_a_report_never_fails_a_committed_row_but_a_skip_shows(tmp_path: Path) -> None:
    store, _, _ = make_job(tmp_path)
    ingest(store, (10, "saved"), (10, "committed"), (20, "saved"), (20, "committed"))
    ingest(store, (10, "failed"), (20, "abandoned"))  # e.g. a cleanup error taken for these
    assert phases(store) == {10: "committed", 20: "committed"}
    ingest(store, (20, "skipped"), (10, "deleted"))
    assert phases(store) == {10: "deleted", 20: "skipped"}
    assert store.checkpoints("idx")[1].detail == "skipped detail"
    ingest(store, (20, "saved"), (20, "failed"))  # a re-save of the step the store refuses
    assert phases(store)[20] == "skipped" and store.checkpoints("idx")[1].detail == "skipped detail"
    ingest(store, (20, "committed"), (10, "saved"))  # deleted, then saved and committed again
    assert phases(store) == {10: "saved", 20: "committed"}


def test_reconcile_sets_what_the_store_proves(tmp_path: Path) -> None:
    store, storage, job_id = make_job(tmp_path, keep_last=2)
    local = tmp_path / "local"
    for step in (10, 20, 30, 40):
        commit(storage, local, step, job_id)
    # 10: deleted by retention, 20: its file deleted behind the job's back, 30: a commit that
    # succeeded while its report said failed, 40: committed, one byte flipped (same size)
    storage.delete([o.key for o in storage.list(layout.step_prefix(10))])
    ingest(store, (10, "committed"), (20, "committed"), (30, "saved"), (30, "failed"),
           (40, "committed"))
    victim = next(o.key for o in storage.list(layout.files_prefix(20)))
    storage.delete([victim])
    shard = tmp_path / "store" / "idx" / next(o.key for o in storage.list(layout.files_prefix(40)))
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))

    metrics = Metrics()
    result = reconcile(store, metrics, "idx")
    assert phases(store) == {10: "deleted", 20: "corrupt", 30: "committed", 40: "committed"}
    assert set(result.changes) == {10, 20, 30}
    events = {e.step: e for e in store.events(job="idx", kinds=["checkpoint"])}
    assert events[30].cause == "reconciled" and "said failed" in events[30].message
    assert events[20].cause == "corrupt" and "missing in the store" in events[20].message
    assert reconcile(store, metrics, "idx").changes == {}  # idempotent

    verified = reconcile(store, metrics, "idx", checksums=True)  # ds3dctl checkpoints --verify
    assert list(verified.changes) == [40] and phases(store)[40] == "corrupt"
    assert "sha256" in store.checkpoints("idx")[-1].detail
    got = metrics.registry.get_sample_value("ds3d_checkpoint_problems_total",
                                            {"job": "idx", "problem": "corrupt"})
    assert got == 2.0


def test_checkpoint_trouble_and_the_commit_after_it_reconcile_in_the_background(
        tmp_path: Path) -> None:
    """After an outage mid-commit the reports said `failed` for a step the store holds
    committed: the trouble, and again the next commit, make the daemon reconcile."""
    from ds3d.daemon.ckpt_index import IndexReconciler

    store, storage, job_id = make_job(tmp_path)
    ingest(store, (10, "saved"), (10, "failed"))
    commit(storage, tmp_path / "local", 10, job_id)  # the commit reached the store after all
    reconciler = IndexReconciler(store, Metrics(), "idx", retry_s=0.1)
    reconciler.observe([{"kind": "checkpoint", "phase": "uploaded", "step": 10}])
    reconciler.wait(10)
    assert phases(store) == {10: "failed"}  # progress reports do not trigger it
    reconciler.observe([{"kind": "checkpoint", "phase": "failed", "step": 10}])
    reconciler.wait(10)
    assert phases(store) == {10: "committed"}
    commit(storage, tmp_path / "local", 20, job_id)
    reconciler.observe([{"kind": "checkpoint", "phase": "committed", "step": 20}])
    reconciler.wait(10)
    assert phases(store) == {10: "committed", 20: "committed"}


def test_a_failed_load_reconciles_the_rollback_target(tmp_path: Path) -> None:
    """A worker that crashed right after a commit never reported it: the index says `saved`
    for a step the store holds committed. A checkpoint that then fails to load makes the
    daemon reconcile, so the automatic rollback past it (which targets the index's committed
    rows) finds that step."""
    from ds3d.daemon.ckpt_index import IndexReconciler

    store, storage, job_id = make_job(tmp_path)
    ingest(store, (10, "saved"), (20, "saved"), (20, "committed"))
    commit(storage, tmp_path / "local", 10, job_id)
    commit(storage, tmp_path / "local", 20, job_id)
    reconciler = IndexReconciler(store, Metrics(), "idx", retry_s=0.1)
    reconciler.observe([{"kind": "checkpoint", "phase": "load_failed", "step": 20}])
    reconciler.wait(10)
    assert phases(store) == {10: "committed", 20: "committed"}


def test_checkpoints_a_rollback_or_a_recovery_deleted_are_listed_as_deleted(tmp_path: Path
                                                                            ) -> None:
    """`ds3dctl rollback JOB 20` deletes the newer checkpoints; the index listed them as
    committed, then the next reconciliation called them `missing` (a problem, with a metric).
    A fault recovery that drops checkpoints of suspect steps is the same."""
    from ds3d.daemon.jobdir import JobDir
    from ds3d.daemon.reports import ReportTail
    from ds3d.trainer.report import Reporter

    store = Store(tmp_path / "ds3d.db")
    jd = JobDir(tmp_path / "jobs", "idx")
    jd.create("{}")
    store.create_job("idx", "{}", "n", str(jd.path))
    rep = Reporter(jd.path, 0, 0)
    for step in (10, 20, 30, 40):
        rep.emit("checkpoint", step=step, phase="committed")
    rep.emit("checkpoint", step=20, phase="rolled_back", detail="deleted newer checkpoints "
             "[30, 40]", deleted=[30, 40])
    rep.emit("checkpoint", step=30, phase="committed")  # the new timeline's
    rep.emit("checkpoint", step=35, phase="committed")
    rep.emit("recovery", cause="spike", step=38, recovered_to=30, steps_lost=8,
             dropped_checkpoints=[35])
    rep.close()
    ReportTail(store, jd).poll()
    rows = {r.step: (r.phase, r.detail) for r in store.checkpoints("idx")}
    assert rows[40] == ("deleted", "deleted by the rollback to step 20")
    assert rows[35] == ("deleted", "deleted by the recovery to step 30 (trained on suspect "
                                   "steps)")
    assert rows[10][0] == rows[20][0] == rows[30][0] == "committed"
    store.close()
