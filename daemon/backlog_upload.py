"""Uploading a job's checkpoints that are local-complete but not durable after its workers exit.

The workers wait at their end for their newest checkpoint to be durable, but only for
`checkpoint.store_wait_s` (trainer/loop.py `wait_for_store`); a worker can also exit earlier
(stop --now, a crash after which nothing is relaunched). What is left is recorded in this
node's local tier: each rank's marker (`L/.ds3d/step-N/rank-R.json`: `pending`, `failed`,
`uploaded`; `committed` once durable) with its file list, metadata and, for S3, the multipart
journal. This module finishes that work in the daemon with the checkpoints package's own
`Uploader` (`resume_pending`), one per rank found here: the same local-complete hashes, part
manifests, rank-0 commit (conditional MANIFEST put, read back, `latest`) and multipart resume,
never a second copy of that logic. Each node uploads its own ranks' files; the node holding
rank 0's marker commits once every rank's part is in the store, as the workers do.

Progress goes where the workers' goes: `checkpoint` records appended to the ranks' report files
(trainer/report.py), so the daemon's report tail turns them into events, checkpoint index rows
and the job's newest checkpoint step exactly as for the workers' own records. Nothing else is
kept: the markers are the state on disk, so a restarted daemon finds the same backlog again
(on a node running a share, once it has found the share's exited agent again: peers.Shares).
Retention and the sweep of leftovers run once, after the whole backlog is durable (never while a
step here still needs its parts or local files)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog
from ds3d.checkpoints.errors import Ds3dError
from ds3d.checkpoints.storage import Storage
from ds3d.checkpoints.upload import Uploader, UploadEvent, read_marker
from ds3d.trainer.config import JobConfig
from ds3d.trainer.kinds import RecordKind
from ds3d.trainer.report import Reporter

from .ckpt_index import config_storage
from .logging import get_logger

# markers whose upload will never be retried (checkpoints/upload.py `Uploader._process`)
_GIVEN_UP = ("abandoned:", "local files unreadable:")
# first retry after a failed attempt, then doubling up to MAX_RETRY_S (ds3dd --backlog-retry-max)
RETRY_S, MAX_RETRY_S = 2.0, 30.0


@dataclass(frozen=True)
class Pending:
    """One rank's checkpoint not yet done on this node: its step, marker state and the error
    of its last failed attempt ("" if none)."""

    step: int
    rank: int
    state: str
    error: str


def local_backlog(local_dir: Path) -> list[Pending]:
    """This node's unfinished uploads, from the ranks' markers: `pending` or `failed` (unless
    given up for good), and on rank 0 (the committer) also `uploaded` (not committed yet)."""
    out = []
    for marker in sorted(local_dir.glob(f"{layout.LOCAL_STATE_DIR}/step-*/rank-*.json")):
        rec = read_marker(marker)
        if not rec or rec.get("meta") is None:
            continue
        state, rank, error = str(rec.get("state")), int(rec.get("rank", -1)), \
            str(rec.get("error") or "")
        if state == "committed" or (state == "uploaded" and rank != 0):
            continue
        if state == "failed" and error.startswith(_GIVEN_UP):
            continue
        out.append(Pending(int(rec["step"]), rank, state, error))
    return out


def awaiting_commit(local_dir: Path) -> int | None:
    """This node's newest checkpoint step when its part here is uploaded and rank 0 runs on
    another node (no rank-0 marker of it here): that node owes its commit. Nothing is left to
    upload here, but the job's end waits for it. None otherwise (local_backlog covers a step
    whose rank 0 is here or whose part here is not uploaded yet)."""
    steps: dict[int, list[tuple[int, str]]] = {}  # step -> (rank, marker state) here
    for marker in local_dir.glob(f"{layout.LOCAL_STATE_DIR}/step-*/rank-*.json"):
        rec = read_marker(marker)
        if rec and rec.get("meta") is not None:
            steps.setdefault(int(rec["step"]), []).append(
                (int(rec.get("rank", -1)), str(rec.get("state"))))
    if not steps:
        return None
    newest = max(steps)
    here = steps[newest]
    if any(rank == 0 for rank, _ in here) or any(state != "uploaded" for _, state in here):
        return None
    return newest


class BacklogUpload:
    """Uploads (and, holding rank 0, commits) one job's backlog on this node in background
    threads, retrying with backoff while the store is down. `pending()` empties once every step
    is committed (rank 0) or uploaded (other ranks), or given up as abandoned. `remote_steps`:
    steps whose parts here are uploaded and whose commit another node owes (awaiting_commit):
    nothing to do here, but `not_durable` names them until their MANIFEST is in the store."""

    def __init__(self, cfg: JobConfig, job_id: str, run_dir: Path, local_dir: Path,
                 restart: int = 0, storage: Storage | None = None, retry_s: float = RETRY_S,
                 max_retry_s: float = MAX_RETRY_S, remote_steps: tuple[int, ...] = ()) -> None:
        self.job_name, self.job_id, self.cfg = cfg.name, job_id, cfg
        self.run_dir, self.local_dir = run_dir, local_dir
        self.log = get_logger("ds3d.backlog", job=cfg.name)
        found = local_backlog(local_dir)
        self.steps = sorted({p.step for p in found} | set(remote_steps))
        self.errors: dict[int, str] = {p.step: p.error for p in found if p.error}
        self.committed: list[int] = []
        self.abandoned: list[int] = []
        self.started = time.time()
        self.storage = storage or config_storage(cfg, run_dir)
        self._reporters: dict[int, Reporter] = {}
        self._uploaders: list[Uploader] = []
        self._closed = False
        for rank in sorted({p.rank for p in found}):  # remote_steps alone: no records
            self._reporters[rank] = Reporter(run_dir, rank, restart)
            up = Uploader(self.storage, local_dir, rank, cfg.parallel.world_size,
                          committer=rank == 0, retry_interval=retry_s,
                          max_retry_interval=max_retry_s, on_event=self._on_event)
            self._uploaders.append(up)
            up.resume_pending()
        self.log.info("backlog_upload_started", steps=self.steps,
                      ranks=sorted(self._reporters))

    @classmethod
    def start_if_needed(cls, cfg: JobConfig, job_id: str, run_dir: Path, local_dir: Path,
                        restart: int = 0, remote_commit: bool = False,
                        max_retry_s: float = MAX_RETRY_S) -> BacklogUpload | None:
        """A running backlog upload, or None when this node has nothing left to upload and,
        with `remote_commit` (the node that decides the job's end), its newest checkpoint is
        not one whose commit another node still owes (awaiting_commit, checked against the
        store: owed while the store cannot be read)."""
        found = local_backlog(local_dir)
        owed = awaiting_commit(local_dir) if remote_commit else None
        if not found and owed is None:
            return None
        storage = config_storage(cfg, run_dir)
        remote = [] if owed is None else [owed]
        try:
            remote = [s for s in remote if not storage.exists(layout.manifest_key(s))]
        except Ds3dError:
            pass
        if not found and not remote:
            return None
        return cls(cfg, job_id, run_dir, local_dir, restart, storage=storage,
                   max_retry_s=max_retry_s, remote_steps=tuple(remote))

    def not_durable(self) -> list[int]:
        """Steps of this backlog (not abandoned) whose MANIFEST the store does not hold: with
        this node's parts uploaded, a step whose rank 0 runs on another node waits for that
        node's daemon to commit it. All of them while the store cannot be read."""
        steps = [s for s in self.steps if s not in self.abandoned]
        try:
            return [s for s in steps if not self.storage.exists(layout.manifest_key(s))]
        except Ds3dError:
            return steps

    def finish_when_done(self, every_s: float = 1.0) -> None:
        """For a node that does not decide the job's end (a share node): a thread that calls
        `finish` once nothing is pending here."""
        def watch() -> None:
            while self.pending() and not self._closed:
                time.sleep(every_s)
            if not self._closed:
                self.finish()
                self.log.info("backlog_upload_done", committed=sorted(self.committed),
                              abandoned=sorted(self.abandoned))
        threading.Thread(target=watch, name=f"backlog-{self.job_name}", daemon=True).start()

    def pending(self) -> list[int]:
        """Steps still queued, in flight or failed and waiting for a retry, on any rank here."""
        return sorted({s for up in self._uploaders for s in up.pending()})

    def failed(self) -> list[int]:
        return sorted({s for up in self._uploaders for s in up.failed()})

    def describe(self) -> str:
        """What is pending and why, for the job's status message."""
        pending = self.pending()
        if not pending:
            return f"backlog durable: steps {self.committed} committed by ds3dd"
        final = pending[-1]
        error = self.errors.get(final) or next(
            (self.errors[s] for s in reversed(pending) if s in self.errors), "")
        why = f"waits for the store: {error}" if error else "is being uploaded by ds3dd"
        return (f"final checkpoint step {final} {why}; {len(pending)} checkpoint(s) pending "
                f"(steps {pending}) for {time.time() - self.started:.0f} s: the workers exited, "
                f"ds3dd uploads them from this node's local tier with retries")

    def finish(self) -> None:
        """Once nothing is pending: retention and the sweep of leftovers, as the workers run
        them after a commit (only on the node that committed, and only now, so nothing the
        backlog needed is deleted), then the threads and report files are closed."""
        if self.committed:
            c = self.cfg.checkpoint
            catalog = Catalog(self.storage, self.local_dir, job_id=self.job_id or None)
            step = max(self.committed)
            try:
                kept = catalog.apply_retention(c.keep_last, c.keep_every)
                swept = catalog.sweep(c.cleanup_grace_s)
            except Ds3dError as e:
                self._emit(0, step, "cleanup_failed", cause="retention", detail=str(e))
            else:
                if kept.deleted:
                    self._emit(0, step, "retention", detail=f"deleted {kept.deleted}",
                               deleted=kept.deleted)
                for failed_step, error in kept.failed.items():
                    self._emit(0, failed_step, "cleanup_failed", cause="retention",
                               detail=error)
                for what, error in swept.failed.items():
                    self._emit(0, step, "cleanup_failed", cause="leftovers",
                               detail=f"{what}: {error}")
        self.close()

    def close(self) -> None:
        """Stops the threads after the attempt in flight; what is left stays in the markers."""
        if self._closed:
            return
        self._closed = True
        for up in self._uploaders:
            up.close(timeout=10)
        for rep in self._reporters.values():
            rep.close(wait_s=5.0)

    def _on_event(self, ev: UploadEvent) -> None:
        if ev.kind == "failed":
            self.errors[ev.step] = ev.detail
        elif ev.kind == "committed":
            self.errors.pop(ev.step, None)
            self.committed.append(ev.step)
        elif ev.kind == "abandoned":
            self.abandoned.append(ev.step)
        self._emit(ev.rank, ev.step, ev.kind, seconds=ev.seconds, detail=ev.detail)
        self.log.info("backlog_upload", step=ev.step, rank=ev.rank, phase=ev.kind,
                      detail=ev.detail)

    def _emit(self, rank: int, step: int, phase: str, **fields: object) -> None:
        reporter = self._reporters.get(rank) or next(iter(self._reporters.values()))
        reporter.emit(RecordKind.CHECKPOINT, step=step, phase=phase, source="ds3dd", **fields)
