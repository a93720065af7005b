"""Keeping the daemon's checkpoint index true to the store.

The index (the `checkpoints` table) is built from the workers' reports, which can be wrong in
both directions: a commit that reached the store while its report said `failed` (an outage
mid-commit), a checkpoint deleted or damaged behind the job's back, a step a restore skipped.
The store is the truth, so the index is reconciled with it:

- when the daemon starts supervising a job (a daemon restart),
- after checkpoint trouble (a failed, abandoned or skipped checkpoint, one that could not be
  loaded, and the next commit after such trouble: the end of an outage), in the background,
  retried while the store is out,
- on demand, `ds3dctl checkpoints JOB --verify` (ListCheckpoints verify), which also downloads
  every committed file and checks its sha256.

What the store shows wins: a complete MANIFEST (this job's, every file present with its size,
and its sha256 with --verify) is `committed`; a MANIFEST with files missing, short or hashing
wrong, or unreadable, is `corrupt`; another job's is `foreign`; a step the index calls committed
that the store no longer has is `deleted` when retention would have removed it, else `missing`.
Every change is an event (kind "checkpoint", cause "reconciled" or the problem) and a metric.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds3d.checkpoints.catalog import Catalog, CheckpointInfo, CkptState
from ds3d.checkpoints.retention import plan_retention
from ds3d.checkpoints.storage import Storage, job_store_url, open_storage
from ds3d.trainer.config import JobConfig
from ds3d.trainer.errors import Ds3dError
from ds3d.trainer.kinds import EventKind

from .logging import get_logger
from .metrics import Metrics
from .store import CheckpointRow, Job, Store

# The store's verdicts that are problems (counted in ds3d_checkpoint_problems_total)
_PROBLEMS = ("corrupt", "missing", "foreign")
# Report phases after which the index is reconciled (in the background). `load_failed`: the
# automatic rollback past an unloadable checkpoint targets the newest step the index has as
# committed, and a worker that crashed right after a commit may never have reported it
TROUBLE_PHASES = ("failed", "abandoned", "skipped", "cleanup_failed", "load_failed")


@dataclass
class Reconciliation:
    """What one reconciliation changed: step -> (old phase or "", new phase, why)."""

    changes: dict[int, tuple[str, str, str]] = field(default_factory=dict)
    checksums: bool = False

    def lines(self) -> list[str]:
        return [f"step {step}: {old or 'not indexed'} -> {new}: {why}"
                for step, (old, new, why) in sorted(self.changes.items())]


def job_storage(job: Job) -> Storage:
    """The job's store prefix, opened as its workers open it."""
    return config_storage(JobConfig.model_validate_json(job.config_json), job.run_dir)


def config_storage(cfg: JobConfig, run_dir: str | Path) -> Storage:
    """The store prefix of the job `cfg` run from `run_dir` on this node (a share node has no
    stored job, only its configuration)."""
    url = job_store_url(cfg.checkpoint.store, cfg.name, run_dir)
    options: dict[str, Any] = {}
    if url.startswith("s3://"):
        from ds3d.checkpoints.s3_storage import options_from_settings

        options = options_from_settings(cfg.checkpoint.s3.model_dump())
    return open_storage(url, **options)


def reconcile(store: Store, metrics: Metrics, name: str, checksums: bool = False,
              storage: Storage | None = None) -> Reconciliation:
    """Reads the job's store and corrects its index rows (one transaction, one event per
    change). Raises the store's error (StorageError...) when it cannot be read: nothing is
    changed then."""
    job = store.get_job(name)
    cfg = JobConfig.model_validate_json(job.config_json)
    catalog = Catalog(storage or job_storage(job), None, job_id=job.job_id or None)
    infos = {c.step: c for c in catalog.list()}
    if checksums:
        for info in infos.values():
            if info.state is CkptState.COMMITTED and (problems := catalog.verify(info.step, True)):
                info.state, info.problems = CkptState.CORRUPT, problems
    rows = {r.step: r for r in store.checkpoints(name)}
    in_store = [s for s, i in infos.items() if i.state is CkptState.COMMITTED]
    result = Reconciliation(checksums=checksums)
    for step, info in infos.items():
        verdict = _verdict(info, rows.get(step), checksums)
        if verdict is not None:
            result.changes[step] = verdict
    for step, row in rows.items():
        if step in infos or row.phase != "committed":
            continue
        retired = step in plan_retention(in_store + [step], cfg.checkpoint.keep_last,
                                         cfg.checkpoint.keep_every)
        result.changes[step] = (row.phase, "deleted" if retired else "missing",
                                "the store has no object of this step" +
                                (" (retention removed it)" if retired else ""))
    now = time.time()
    new_rows, events = [], []
    for step, (old, new, why) in sorted(result.changes.items()):
        indexed = rows.get(step)
        new_rows.append({"step": step, "phase": new, "detail": why,
                         "time": indexed.time if indexed else now})
        cause = new if new in _PROBLEMS else "reconciled"
        events.append({"time": now, "kind": EventKind.CHECKPOINT, "step": step, "cause": cause,
                       "message": f"checkpoint step {step}: the index said {old or 'nothing'}; "
                                  f"the store shows {new}: {why}",
                       "detail": {"phase": new, "previous": old, "why": why,
                                  "checksums": checksums}})
        metrics.checkpoint_index_fixed.labels(name, new).inc()
        if new in _PROBLEMS:
            metrics.checkpoint_problems.labels(name, new).inc()
    if new_rows:
        store.reconcile_checkpoints(name, new_rows, events)
    return result


def _verdict(info: CheckpointInfo, row: CheckpointRow | None,
             checksums: bool) -> tuple[str, str, str] | None:
    """(old phase, new phase, why) when the store proves the row wrong, else None."""
    old = row.phase if row else ""
    if info.state is CkptState.COMMITTED:
        new = "committed"
        why = ("a complete MANIFEST, every file present with its size" +
               (" and sha256" if checksums else ""))
    elif info.state in (CkptState.CORRUPT, CkptState.FOREIGN):
        new, why = info.state.value, "; ".join(info.problems[:5])
    elif old == "committed":  # objects but no MANIFEST: the commit was undone
        new, why = "missing", "the store has objects of this step but no MANIFEST"
    else:
        return None  # still uploading, or abandoned: the reports say which
    if new == old and (row is None or new == "committed" or row.detail == why):
        return None
    if old in ("skipped", "corrupt") and new == "committed" and not checksums:
        return None  # found damaged by a hash: sizes alone cannot clear it, --verify can
    return old, new, why


class IndexReconciler:
    """Runs `reconcile` for one job in a background thread when asked (never in the
    supervisor's tick: a store can be slow or out). Requests while one runs make it run once
    more; a store that cannot be read is retried every `retry_s`, up to `attempts` times."""

    def __init__(self, store: Store, metrics: Metrics, name: str, retry_s: float = 30.0,
                 attempts: int = 10) -> None:
        self.store, self.metrics, self.name = store, metrics, name
        self.retry_s, self.attempts = retry_s, attempts
        self.log = get_logger("ds3d.ckpt_index", job=name)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._again = False
        self._trouble = False
        self.stopping = threading.Event()

    def observe(self, records: list[dict[str, Any]]) -> None:
        """Checkpoint report records of one tick: trouble, and the first commit after it,
        ask for a reconciliation."""
        phases = [r.get("phase") for r in records]
        if any(p in TROUBLE_PHASES for p in phases):
            self._trouble = True
            self.request("checkpoint trouble reported")
        elif self._trouble and "committed" in phases:
            self._trouble = False
            self.request("a commit after checkpoint trouble")

    def request(self, why: str) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._again = True
                return
            self._thread = threading.Thread(target=self._run, args=(why,),
                                            name=f"ckpt-index-{self.name}", daemon=True)
            self._thread.start()

    def wait(self, timeout: float) -> None:
        t = self._thread
        if t is not None:
            t.join(timeout)

    def _run(self, why: str) -> None:
        while True:
            for attempt in range(1, self.attempts + 1):
                try:
                    result = reconcile(self.store, self.metrics, self.name)
                except Ds3dError as e:
                    self.log.warning("checkpoint index not reconciled", why=why,
                                     attempt=attempt, error=str(e))
                    if self.stopping.wait(self.retry_s):
                        return
                    continue
                if result.changes:
                    self.log.info("checkpoint index reconciled", why=why, changes=result.lines())
                break
            with self._lock:
                if not self._again:
                    self._thread = None
                    return
                self._again = False
