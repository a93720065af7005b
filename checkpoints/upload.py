"""Getting a saved checkpoint from the local tier into the store, without training waiting.

Protocol (see layout.py): every rank uploads its own files, then writes its part manifest; one
committer (rank 0) polls the store until all `world_size` parts exist, merges them and writes
MANIFEST.json last with a conditional put, reads it back, then moves the `latest` pointer.
Ranks never use collectives here: this runs in background threads (or its own process), and a
background thread sharing the training process group has deadlocked jobs before.

`Uploader` runs that in one background thread per rank, fed by a queue. A second save while an
upload is still running is QUEUED, not dropped and not run in parallel: uploads happen in step
order, each checkpoint's local files stay untouched until their upload ends (the trainer saves
each step into its own tag folder), so a newer save never overwrites an older one in flight,
and the store's bandwidth goes to one checkpoint at a time, so the oldest becomes durable first
(dropping it would leave the job with nothing durable under a slow store). If saves outpace
uploads, the queue grows; `pending()` tells the trainer so it can save less often.

A failed upload (after storage retries) leaves the local checkpoint in place, marks it
`failed` in the local marker (`L/.ds3d/step-N/rank-R.json`, which also keeps the file list and
metadata so a restarted process can resume it: `resume_pending`), emits an event, and is retried
by the Uploader when its queue is idle and `retry_interval` has passed. A retry does not start
the large files over: on a store that resumes multipart uploads (S3), the UploadIds of a rank's
unfinished uploads are journaled beside its marker (`L/.ds3d/step-N/multipart-rank-R.json`), and
the retry, in this process or the next, sends only the parts the store does not have yet. When
a checkpoint is abandoned (its local files are gone), its journaled uploads are aborted.

Run as a process: `python -m ds3d.checkpoints.upload --store URL --step N --rank R
--world-size W --dir LOCAL [--commit]`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import structlog
from pydantic import ValidationError

from . import layout
from .atomic_file import replace_file
from .deepspeed_latest import refresh_local_latest, write_store_latest
from .disk_space import is_disk_full
from .errors import CheckpointError, ConfigError, Ds3dError, NotFoundError
from .hashing_writer import WrittenSave
from .identity import ForeignPrefixError, manifest_is_mine
from .local_complete import read_record, remove_record, write_record
from .logs import configure_logging
from .manifest import (
    CheckpointMeta,
    FileEntry,
    Layout,
    Manifest,
    PartManifest,
    file_entries,
    list_checkpoint_files,
    merge_parts,
    save_local_manifest,
    size_problems,
)
from .storage import Storage, open_storage

log = structlog.get_logger("ds3d.checkpoints.upload")

MarkerState = Literal["pending", "failed", "uploaded", "committed"]


# -- local markers ---------------------------------------------------------------------------


def write_marker(local_dir: str | Path, step: int, rank: int, state: MarkerState,
                 files: list[str], meta: CheckpointMeta | None, error: str | None = None) -> None:
    """Atomically records this rank's upload state of a step in the local tier."""
    path = layout.local_rank_marker(local_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"state": state, "step": step, "rank": rank, "time": time.time(), "error": error,
              "files": files, "meta": meta.model_dump(mode="json") if meta else None}
    try:  # the upload thread and a rollback's drop (main thread) may mark one step at once
        replace_file(path, json.dumps(record))
    except OSError:  # a full disk: no partial temp file (nor a folder of nothing) is left
        with suppress(OSError):
            path.parent.rmdir()  # only when empty: another marker or record keeps it
        raise


def read_marker(path: str | Path) -> dict[str, Any] | None:
    try:
        data = json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


@runtime_checkable
class ResumableUploads(Protocol):
    """A store whose large uploads continue where they stopped (S3Storage), given a journal."""

    def upload_journal(self, path: str | Path) -> AbstractContextManager[Any]: ...

    def abort_journaled_uploads(self, path: str | Path, cause: str) -> int: ...


def multipart_journal_path(local_dir: str | Path, step: int, rank: int) -> Path:
    """Where rank `rank` journals the UploadIds of its unfinished uploads of `step`."""
    return layout.local_state_dir(local_dir, step) / f"multipart-rank-{rank:05d}.json"


def _journal(storage: Storage, local_dir: str | Path, step: int,
             rank: int) -> AbstractContextManager[Any]:
    if isinstance(storage, ResumableUploads):
        return storage.upload_journal(multipart_journal_path(local_dir, step, rank))
    return nullcontext()


# -- one rank's upload, one commit -----------------------------------------------------------


def upload_rank_files(storage: Storage, step: int, rank: int, local_ckpt_dir: str | Path,
                      files: list[str], job_id: str | None = None,
                      entries: list[FileEntry] | None = None) -> PartManifest:
    """Uploads this rank's files (paths relative to `local_ckpt_dir`), then its part manifest
    (naming `job_id`, the uploading job).

    Refuses to touch a step whose MANIFEST already exists unless it lists these very files
    (then the upload already happened: idempotent after a crash before the marker was updated)
    and names this job (a step committed by another job is never overwritten). `entries`: the
    files' sizes and sha256 when already computed (at save, local_complete.py).
    """
    if entries is None:
        entries = file_entries(local_ckpt_dir, files)
    existing = live_manifest(storage, step, job_id)
    part = PartManifest(step=step, rank=rank, job_id=job_id, created=time.time(), files=entries)
    if existing is not None and not manifest_is_mine(existing.job_id, job_id):
        raise ForeignPrefixError(f"step {step} in {storage.url} was committed by job "
                                 f"{existing.job!r} (id {existing.job_id}), not by this job (id "
                                 f"{job_id}); it is not overwritten")
    if existing is not None:
        committed = {e.path: e for e in existing.files}
        if all(e.path in committed and committed[e.path].same_bytes(e) for e in entries):
            return part
        raise CheckpointError(f"step {step} is already committed in {storage.url} with other "
                              "files; delete it before saving that step again")
    t0 = time.monotonic()
    with _journal(storage, local_ckpt_dir, step, rank):
        for entry in entries:
            storage.put_file(Path(local_ckpt_dir) / entry.path, layout.file_key(step, entry.path))
    storage.put_bytes(layout.part_key(step, rank), part.model_dump_json().encode())
    log.info("rank_uploaded", step=step, rank=rank, files=len(entries),
             bytes=sum(e.size for e in entries), seconds=round(time.monotonic() - t0, 3))
    return part


class PartsMissing(CheckpointError):
    """Some ranks' parts did not arrive within the commit timeout."""


# A commit resumed by a new process waits at most this long for the other ranks' parts: when the
# node that owed one is gone, the checkpoint is abandoned instead of holding up newer ones.
RESUMED_COMMIT_TIMEOUT_S = 60.0


def commit_checkpoint(storage: Storage, step: int, world_size: int, meta: CheckpointMeta,
                      timeout: float, poll_interval: float = 0.5,
                      cancelled: Callable[[], str | None] | None = None) -> Manifest:
    """Waits (up to `timeout` s, or until `cancelled()` gives a reason) for all parts, merges
    them, writes MANIFEST.json last and verifies what the store holds. The store is listed at
    least once: parts all there commit even when cancelled. Safe to repeat: an identical
    existing manifest is accepted."""
    deadline = time.monotonic() + timeout
    want = set(range(world_size))
    while True:
        have = {r for o in storage.list(layout.parts_prefix(step))
                if (r := layout.rank_of_part_key(o.key)) is not None}
        if want <= have:
            break
        why = cancelled() if cancelled is not None else None
        if why:
            raise PartsMissing(f"step {step}: {why}; never committed (missing ranks "
                               f"{sorted(want - have)[:16]})")
        if time.monotonic() >= deadline:
            missing = sorted(want - have)
            raise PartsMissing(
                f"step {step}: only {len(have & want)} of {world_size} ranks uploaded their part "
                f"within {timeout:.0f} s (missing ranks {missing[:16]}); the checkpoint stays "
                "uncommitted")
        time.sleep(poll_interval)
    parts = []
    for r in sorted(want):
        try:
            raw = storage.get_bytes(layout.part_key(step, r))
            parts.append(PartManifest.model_validate_json(raw))
        except ValidationError as e:
            raise CheckpointError(f"step {step}: part of rank {r} is unreadable: {e}") from None
    try:
        manifest = merge_parts(step, meta, parts)
    except ValueError as e:
        raise CheckpointError(f"step {step}: {e}") from None
    stored = {o.key: o.size for o in storage.list(layout.files_prefix(step))}
    for entry in manifest.files:
        size = stored.get(layout.file_key(step, entry.path))
        if size != entry.size:
            raise CheckpointError(f"step {step}: {entry.path} is "
                                  f"{'missing' if size is None else f'{size} bytes'} in the "
                                  f"store, its part says {entry.size} bytes")
    write_store_latest(storage, step, meta.tag)  # DeepSpeed's pointer inside files/
    key = layout.manifest_key(step)
    data = manifest.to_json()
    # Check first, then put-if-absent: on a store that ignores the condition, the check still
    # keeps a committed manifest from being replaced (one committer per job makes a race rare).
    written = live_manifest(storage, step, meta.job_id) is None and \
        storage.put_bytes(key, data, if_absent=True)  # (a dead one is deleted by the check)
    # Read back whatever the store now holds: a server may ignore the condition, or another
    # committer may have won; either way the stored manifest must list exactly these files.
    try:
        final = Manifest.from_json(storage.get_bytes(key))
    except ValidationError:
        raise CheckpointError(f"step {step}: the MANIFEST read back from {storage.url} is "
                              "unreadable; the store does not keep what it was given") from None
    if not manifest_is_mine(final.job_id, meta.job_id):
        raise ForeignPrefixError(f"step {step} in {storage.url} was committed by job "
                                 f"{final.job!r} (id {final.job_id}), not by this job (id "
                                 f"{meta.job_id}); it is not overwritten")
    if final.files != manifest.files or final.step != step:
        raise CheckpointError(f"step {step}: a different MANIFEST is already committed in "
                              f"{storage.url}; delete that checkpoint before saving it again")
    update_latest(storage, step)
    log.info("checkpoint_committed", step=step, files=len(final.files), bytes=final.total_size,
             written=written)
    return final


def live_manifest(storage: Storage, step: int, job_id: str | None) -> Manifest | None:
    """The MANIFEST committed at `step`, or None when there is none or it is dead: unreadable,
    of another step, or (this job's) listing files the store no longer holds at their size.
    A restore skips such a checkpoint, and the step is trained and saved again: refusing that
    save ("already committed") on every retry wedged the job, so a dead MANIFEST is deleted
    (the step becomes uncommitted) and the new save commits in its place. Another job's is
    returned as it is (callers refuse it)."""
    key = layout.manifest_key(step)
    try:
        old = Manifest.from_json(storage.get_bytes(key))
    except NotFoundError:
        return None
    except ValidationError:
        why = "it is unreadable"
    else:
        why = f"it says step {old.step}" if old.step != step else ""
        if not why and manifest_is_mine(old.job_id, job_id):
            stored = {o.key: o.size for o in storage.list(layout.files_prefix(step))}
            why = next(iter(size_problems(step, old, stored)), "")
        if not why:
            return old
    # uncommitted from here: a rank's upload of the new save would otherwise restore the sizes
    # that made it dead, and the next rank would find it live and refuse its own files
    storage.delete([key])
    log.warning("checkpoint_manifest_dead", step=step, reason=why,
                detail="its MANIFEST is deleted; a new save of the step commits in its place")
    return None


def update_latest(storage: Storage, step: int) -> None:
    """Moves the `latest` pointer forward only (a convenience; never trusted over manifests)."""
    try:
        current = layout.step_of_key(storage.get_bytes(layout.LATEST_KEY).decode().strip() + "/")
    except (NotFoundError, UnicodeDecodeError):
        current = None
    if current is None or current < step:
        storage.put_bytes(layout.LATEST_KEY, (layout.CKPT_ROOT + layout.step_name(step)).encode())


# -- background uploader ---------------------------------------------------------------------


@dataclass(frozen=True)
class UploadEvent:
    # "abandoned": never to be committed (the rank that owed a part is gone, or the local
    # files are); "failed": an attempt failed and will be retried; "local_complete": this
    # rank's files are on local disk and hashed (local_complete.py), before any upload
    kind: Literal["local_complete", "uploaded", "committed", "failed", "abandoned"]
    step: int
    rank: int
    seconds: float
    detail: str = ""
    # "local_complete" of a save this process wrote: write_s (the writer thread's time on the
    # rank's files: serialise, flush, fsync, rename, hashing alongside), hash_wait_s (of which
    # waiting after the fsync for hashes still running), hash_s (reading files back to hash
    # them: 0.0 when all were hashed while written), read_back_files, local_complete_s (from
    # the end of the save's host copy to the record written, queueing behind earlier saves
    # included); of any other (a resumed one): hash_s and read_back_files
    timings: dict[str, float | int] = field(default_factory=dict)


@dataclass
class _Job:
    step: int
    files: list[str]
    meta: CheckpointMeta
    attempts: int = 0
    uploaded: bool = False
    retry_at: float = field(default=0.0)
    resumed: bool = False  # found pending by a new process (resume_pending)
    entries: list[FileEntry] | None = None  # the files' sizes and sha256, once hashed
    dropped: bool = False  # abandoned by a restore to an older step (drop_newer_than)
    parts_gone: list[int] | None = None  # resumed: ranks whose part will never come (start-up)
    written: WrittenSave | None = None  # this process's writer hashed (some of) them: by rel path


def _why_not_waited(job: _Job) -> str | None:
    """Why a commit stops waiting for the other ranks' parts, if it should."""
    if job.dropped:
        return "dropped by a restore to an older step while waiting for the other ranks' parts"
    if job.parts_gone:
        return (f"rank(s) {job.parts_gone} of the same world have no files of it (their "
                "process ended before writing them), so their parts will never come")
    return None


# A worker's failed upload is attempted again this many seconds later; a node-wide setting in
# ds3dd's environment (its workers inherit it), which ds3dd checks at its start.
RETRY_ENV, DEFAULT_RETRY_S, LEAST_RETRY_S = "DS3D_UPLOAD_RETRY_S", 30.0, 1.0


def retry_interval_from_env(environ: Mapping[str, str] | None = None) -> float:
    """The workers' retry interval (RETRY_ENV, else DEFAULT_RETRY_S): how soon after a store
    outage ends the uploads go on, and so how long a job that ended during one waits beyond it.
    A value that is not a number of seconds from LEAST_RETRY_S is a ConfigError naming it."""
    raw = (os.environ if environ is None else environ).get(RETRY_ENV, "").strip()
    if not raw:
        return DEFAULT_RETRY_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= LEAST_RETRY_S):
        raise ConfigError(f"{RETRY_ENV}={raw!r}: expected a number of seconds, at least "
                          f"{LEAST_RETRY_S:g} (default {DEFAULT_RETRY_S:g})")
    return value


class Uploader:
    """One background thread per rank that uploads queued checkpoints in step order, fed by a
    second one that hashes each saved checkpoint's files as soon as they are written (or takes
    the hashes its writer took while writing them) and records them local-complete
    (local_complete.py): a slow or absent store never delays that record."""

    def __init__(self, storage: Storage, local_dir: str | Path, rank: int, world_size: int, *,
                 committer: bool | None = None, commit_timeout: float = 600.0,
                 retry_interval: float = 30.0, max_retry_interval: float | None = None,
                 on_event: Callable[[UploadEvent], None] | None = None) -> None:
        self.storage, self.local_dir = storage, Path(local_dir)
        self.rank, self.world_size = rank, world_size
        self.committer = rank == 0 if committer is None else committer
        self.commit_timeout, self.retry_interval = commit_timeout, retry_interval
        # a failed checkpoint's retries back off (doubling) up to this; None: a fixed interval
        self.max_retry_interval = max_retry_interval
        self.on_event = on_event
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._verify: queue.Queue[_Job | None] = queue.Queue()
        self._jobs: dict[int, _Job] = {}  # known steps' jobs, for drop_newer_than
        self._failed: dict[int, _Job] = {}
        self._known: set[int] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # a job's local marker and record are written, or dropped with its files, one at a time:
        # a drop between a worker thread's "not dropped?" and its write would see them re-created
        self._local_state = threading.Lock()
        self._busy = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ds3d-upload-r{rank}", daemon=True)
        self._thread.start()
        self._verifier = threading.Thread(target=self._verify_loop, name=f"ds3d-verify-r{rank}",
                                          daemon=True)
        self._verifier.start()

    def submit(self, step: int, files: list[str], meta: CheckpointMeta,
               resumed: bool = False, written: WrittenSave | None = None) -> None:
        """Queues a saved checkpoint (files relative to local_dir); returns at once.

        `written`: what this process's writer thread hashed while writing these very files
        (snapshot.py, `SnapshotCheckpointEngine.written`), keyed by the paths it wrote to
        (absolute, or relative to local_dir); those files are not read back to be hashed."""
        if written is not None:
            written = WrittenSave({os.path.relpath(p, self.local_dir): f
                                   for p, f in written.files.items()},
                                  written.queued_at, written.write_s)
        with self._lock:
            if step in self._known:
                return
            self._known.add(step)
            self._busy += 1
            job = self._jobs[step] = _Job(step, list(files), meta, resumed=resumed,
                                          written=written)
        try:
            write_marker(self.local_dir, step, self.rank, "pending", files, meta)
        except BaseException:
            # not queued (a full disk refused the marker, the save's intent): the caller fails
            # the save; a job left counted here would keep `wait` and `pending` busy for good
            with self._idle:
                self._forget(job)
                self._busy -= 1
                self._idle.notify_all()
            raise
        self._verify.put(job)

    def drop_newer_than(self, step: int) -> list[int]:
        """A restore to `step` abandons this rank's uncommitted checkpoints of later steps (a
        timeline that is trained again): their uploads stop, and their local files, marker and
        local-complete record are deleted, so no restart restores or uploads them and a new save
        of the same step starts clean. An upload already in flight finishes; its part is never
        committed, and retention's sweep removes it. Returns the steps dropped."""
        with self._local_state:
            with self._lock:
                jobs = [j for s, j in self._jobs.items() if s > step]
                for job in jobs:
                    job.dropped = True
                    self._known.discard(job.step)
                    self._jobs.pop(job.step, None)
                    self._failed.pop(job.step, None)  # a failed job holds no busy count
            steps = sorted({j.step for j in jobs} | self._stale_local_steps(step))
            for s in steps:
                self._delete_local(s)
        if steps:
            log.info("checkpoint_local_dropped", rank=self.rank, restored=step, steps=steps)
        return steps

    def _stale_local_steps(self, step: int) -> set[int]:
        """Steps after `step` that this rank holds locally, uncommitted, with no job here."""
        out = set()
        for marker in self._markers():
            rec = read_marker(marker)
            if rec and int(rec.get("step", -1)) > step and rec.get("state") != "committed":
                out.add(int(rec["step"]))
        return out

    def _delete_local(self, step: int) -> None:
        rec = read_marker(layout.local_rank_marker(self.local_dir, step, self.rank))
        for rel in (rec or {}).get("files", []):
            try:
                (self.local_dir / layout.check_rel_path(rel)).unlink(missing_ok=True)
            except (OSError, ValueError) as e:
                log.warning("checkpoint_local_delete_failed", step=step, path=rel, detail=str(e))
        remove_record(self.local_dir, step, self.rank)
        layout.local_rank_marker(self.local_dir, step, self.rank).unlink(missing_ok=True)

    def _verify_loop(self) -> None:
        """Hashes each submitted checkpoint's files once (unless its writer hashed them while
        writing them: `submit`'s `written`), records it local-complete, then hands it to the
        upload thread. A resumed one whose record lists the same files keeps the record's
        hashes (the restore that may use it checks them again)."""
        while not self._stop.is_set():
            job = self._verify.get()
            if job is None or self._stop.is_set():
                return
            if not job.dropped:
                self._record_local(job)
            self._queue.put(job)

    def _record_local(self, job: _Job) -> None:
        t0 = time.monotonic()
        old = read_record(self.local_dir, job.step, self.rank) if job.resumed else None
        if old is not None and sorted(e.path for e in old.part.files) == sorted(set(job.files)):
            job.entries = old.part.files
            return
        try:
            job.entries, read_back, hash_s = self._entries(job)
            with self._local_state:
                if job.dropped:
                    return
                write_record(self.local_dir, job.step, self.rank, job.entries, job.meta)
        except (OSError, ValueError) as e:  # files gone: the upload thread abandons it
            log.warning("checkpoint_local_unverified", step=job.step, rank=self.rank,
                        detail=str(e))
            return
        timings = {"hash_s": round(hash_s, 3), "read_back_files": read_back}
        said = []
        w = job.written
        if w is not None:
            timings |= {"write_s": round(w.write_s, 3), "hash_wait_s": round(w.hash_wait_s, 3),
                        "local_complete_s": round(time.monotonic() - w.queued_at, 3)}
            said.append(f"written in {w.write_s:.2f} s")
            if len(job.entries) > read_back:
                said.append(f"{len(job.entries) - read_back} file(s) hashed while written "
                            f"({w.hash_wait_s:.2f} s waited after the fsync)")
        if read_back:
            said.append(f"{read_back} file(s) read back and hashed in {hash_s:.2f} s")
        if w is not None:
            said.append(f"local-complete {timings['local_complete_s']:.2f} s after the snapshot")
        self._emit("local_complete", job, t0, ", ".join(said), timings)

    def _entries(self, job: _Job) -> tuple[list[FileEntry], int, float]:
        """The job's files' entries: each from the hashes its writer took while writing it,
        when there are some and the file is still the size written, else by reading it back.
        Returns (entries, files read back, seconds reading back)."""
        known = {rel: FileEntry(path=rel, size=d.size, sha256=d.sha256,
                                chunk_bytes=d.chunk_bytes, chunk_sha256=d.chunk_sha256)
                 for rel, w in (job.written.files.items() if job.written is not None else ())
                 if (d := w.digest) is not None}
        t0 = time.monotonic()
        entries = file_entries(self.local_dir, job.files, known)
        read_back = sum(1 for e in entries if known.get(e.path) is not e)
        return entries, read_back, time.monotonic() - t0 if read_back else 0.0

    def resume_pending(self) -> list[int]:
        """Re-queues this rank's unfinished uploads found in the local markers (after a restart)."""
        steps = []
        for marker in sorted(self._markers()):
            rec = read_marker(marker)
            if not rec or rec.get("meta") is None:
                continue
            done = rec["state"] == "committed" or (rec["state"] == "uploaded"
                                                   and not self.committer)
            if not done:
                self.submit(int(rec["step"]), list(rec["files"]),
                            CheckpointMeta.model_validate(rec["meta"]), resumed=True)
                steps.append(int(rec["step"]))
        return steps

    def marked_steps(self) -> list[int]:
        """Steps of which this rank has a part to give (an upload marker: pending, uploaded or
        committed); a step it has none of is one whose files it never finished writing."""
        return sorted(int(m.parent.name.removeprefix("step-")) for m in self._markers()
                      if m.parent.name.removeprefix("step-").isdigit())

    def _markers(self) -> Iterator[Path]:
        """This rank's upload markers, one per step it saved and has not deleted."""
        return self.local_dir.glob(f"{layout.LOCAL_STATE_DIR}/step-*/rank-{self.rank:05d}.json")

    def parts_gone(self, marked: list[list[int]], world_size: int) -> dict[int, list[int]]:
        """Rank 0, at start, given every rank's `marked_steps` (by rank, this world): the
        resumed commits of a save made by this same world that some rank has no part of (its
        process died before writing its files: a crash just after a snapshot). Their commit
        lists the store once more instead of waiting RESUMED_COMMIT_TIMEOUT_S for that part,
        which held up every later commit and the job's end. Returns {step: ranks}."""
        gone: dict[int, list[int]] = {}
        with self._lock:
            for job in self._jobs.values():
                if not job.resumed or job.meta.layout.world_size != world_size:
                    continue  # another world's ranks cannot say (a node lost or back)
                lacking = [r for r, steps in enumerate(marked) if job.step not in steps]
                if lacking:
                    job.parts_gone = gone[job.step] = lacking
        return gone

    def pending(self) -> list[int]:
        """Steps queued, in flight, or failed and waiting for a retry."""
        with self._lock:
            return sorted(self._known)

    def failed(self) -> list[int]:
        with self._lock:
            return sorted(self._failed)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or in flight (failed ones may remain); False on
        timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def retry_failed_now(self) -> None:
        with self._lock:
            for job in self._failed.values():
                job.retry_at = 0.0
        self._queue.put(None)

    def close(self, timeout: float | None = None) -> None:
        """Stops after the upload in flight; what is still queued stays `pending` locally and is
        picked up by `resume_pending` in the next process."""
        self._stop.set()
        self._verify.put(None)
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._queue.get(timeout=min(self.retry_interval, 1.0))
            except queue.Empty:
                job = None
            if self._stop.is_set():
                return
            if job is None:
                job = self._due_retry()
                if job is None:
                    continue
            try:
                self._process(job)
            except OSError as e:
                # a local marker write that a full disk refused (inside the error handling):
                # the checkpoint stays local and is retried later, and this thread lives on
                if not is_disk_full(e):
                    raise
                log.warning("checkpoint_upload_disk_full", step=job.step, rank=self.rank,
                            detail=str(e))
                job.retry_at = time.monotonic() + self.retry_interval
                with self._lock:
                    self._failed[job.step] = job

    def _forget(self, job: _Job) -> None:
        """Done with (committed or abandoned); called with the lock held."""
        if self._jobs.get(job.step) is job:
            del self._jobs[job.step]
            self._known.discard(job.step)

    def _due_retry(self) -> _Job | None:
        now = time.monotonic()
        with self._lock:
            due = [j for j in self._failed.values() if j.retry_at <= now]
            if not due:
                return None
            job = min(due, key=lambda j: j.step)
            del self._failed[job.step]
            self._busy += 1
            return job

    def _process(self, job: _Job) -> None:
        if job.dropped:  # a restore to an older step abandoned it while it was queued
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()
            return
        t0 = time.monotonic()
        committed = False
        job.attempts += 1
        try:
            if not job.uploaded:
                upload_rank_files(self.storage, job.step, self.rank, self.local_dir, job.files,
                                  job_id=job.meta.job_id, entries=job.entries)
                job.uploaded = True
                self._mark(job, "uploaded")
                self._emit("uploaded", job, t0)
            if self.committer:
                # the world that saved it: after a node was lost, this process's world is smaller
                manifest = commit_checkpoint(
                    self.storage, job.step, job.meta.layout.world_size, job.meta,
                    timeout=min(self.commit_timeout, RESUMED_COMMIT_TIMEOUT_S) if job.resumed
                    else self.commit_timeout, cancelled=lambda: _why_not_waited(job))
                save_local_manifest(self.local_dir, manifest)
                refresh_local_latest(self.local_dir)
                self._mark(job, "committed")
                committed = True
            with self._lock:
                self._forget(job)
        except PartsMissing as e:
            if not (job.resumed or job.dropped or job.parts_gone):
                self._retry_later(job, t0, e)
            else:  # the rank that owed a part died with its process (or a restore to an older
                # step dropped it): superseded by newer ones
                self._mark(job, "failed", error=f"abandoned: {e}")
                with self._lock:
                    self._forget(job)
                log.warning("checkpoint_commit_abandoned", step=job.step, detail=str(e))
                self._emit("abandoned", job, t0, f"abandoned: {e}")
        except Ds3dError as e:
            self._retry_later(job, t0, e)
        except OSError as e:
            # The local files are gone or unreadable: nothing left to upload from.
            self._mark(job, "failed", error=f"local files unreadable: {e}")
            with self._lock:
                self._forget(job)
            log.error("checkpoint_upload_abandoned", step=job.step, rank=self.rank, detail=str(e))
            self._abort_journaled(job.step)
            self._emit("abandoned", job, t0, f"local files unreadable: {e}")
        except Exception as e:
            # A bug, not a storage problem: logged with its traceback, retried like a failure so
            # the thread (and every later checkpoint) survives it.
            log.exception("checkpoint_upload_bug", step=job.step, rank=self.rank)
            self._mark(job, "failed", error=f"internal error: {e!r}")
            job.retry_at = time.monotonic() + self.retry_interval
            with self._lock:
                self._failed[job.step] = job
            self._emit("failed", job, t0, f"internal error: {e!r}")
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()
        if committed:
            # after the bookkeeping: what the listener does (retention, reports) cannot turn a
            # committed checkpoint into a failed one
            self._emit("committed", job, t0)

    def _mark(self, job: _Job, state: MarkerState, error: str | None = None) -> None:
        """The job's local marker, unless a restore dropped it (its marker is gone for good)."""
        with self._local_state:
            if not job.dropped:
                write_marker(self.local_dir, job.step, self.rank, state, job.files, job.meta,
                             error)

    def _retry_later(self, job: _Job, t0: float, e: Ds3dError) -> None:
        """Terminal and retryable errors alike: the local copy is kept, and a later attempt
        may succeed once the store or the other ranks are back."""
        if job.dropped:
            return
        self._mark(job, "failed", error=str(e))
        job.retry_at = time.monotonic() + self._retry_delay(job)
        with self._lock:
            self._failed[job.step] = job
        log.warning("checkpoint_upload_failed", step=job.step, rank=self.rank,
                    attempt=job.attempts, cause=type(e).__name__, detail=str(e))
        self._emit("failed", job, t0, str(e))

    def _retry_delay(self, job: _Job) -> float:
        """`retry_interval`, doubling with each failed attempt up to `max_retry_interval`."""
        if self.max_retry_interval is None:
            return self.retry_interval
        doubled = self.retry_interval * float(2 ** min(max(job.attempts - 1, 0), 30))
        return min(self.max_retry_interval, doubled)

    def _abort_journaled(self, step: int) -> None:
        """An abandoned checkpoint's unfinished multipart uploads would cost storage forever."""
        if not isinstance(self.storage, ResumableUploads):
            return
        try:
            self.storage.abort_journaled_uploads(
                multipart_journal_path(self.local_dir, step, self.rank),
                cause=f"checkpoint step {step} abandoned: its local files are gone")
        except Ds3dError as e:
            log.warning("multipart_abort_failed", step=step, rank=self.rank, detail=str(e))

    def _emit(self, kind: Literal["local_complete", "uploaded", "committed", "failed",
                                  "abandoned"], job: _Job,
              t0: float, detail: str = "", timings: dict[str, float | int] | None = None) -> None:
        """Tells the listener; its own failure is logged and changes no checkpoint's state."""
        if self.on_event is None:
            return
        try:
            self.on_event(UploadEvent(kind, job.step, self.rank,
                                      round(time.monotonic() - t0, 3), detail, timings or {}))
        except Exception:  # a listener bug must not fail the upload it reports
            log.exception("checkpoint_event_listener_failed", step=job.step, kind=kind)


# -- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds3d.checkpoints.upload",
                                description="Upload one rank's checkpoint files (and commit).")
    p.add_argument("--store", required=True, help="file:///path or s3://bucket/prefix")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--dir", required=True, help="local checkpoint folder (DeepSpeed's save_dir)")
    p.add_argument("--tag", help="sub-folder of --dir to upload; default global_step<STEP>")
    p.add_argument("--files", nargs="*", help="paths relative to --dir; default all under --tag")
    p.add_argument("--commit", action="store_true", help="also commit (wait for all parts)")
    p.add_argument("--commit-timeout", type=float, default=600.0)
    p.add_argument("--job", default="job")
    p.add_argument("--tokens-seen", type=int, default=0)
    p.add_argument("--layout", default=None, help="TP,PP,DP (default 1,1,world-size)")
    p.add_argument("--threshold-mib", type=int, help="S3 multipart threshold")
    p.add_argument("--chunk-mib", type=int, help="S3 multipart part size")
    p.add_argument("--concurrency", type=int, help="S3 parallel parts")
    p.add_argument("--max-bandwidth-mib", type=float, help="S3 bandwidth limit, MiB/s")
    a = p.parse_args(argv)
    configure_logging()

    tag = a.tag or layout.default_tag(a.step)
    files = a.files if a.files else list_checkpoint_files(a.dir, tag)
    if not files:
        p.error(f"no files to upload under {Path(a.dir) / tag}; check --dir, --tag and --step")
    tp, pp, dp = (int(x) for x in a.layout.split(",")) if a.layout else (1, 1, a.world_size)
    meta = CheckpointMeta(job=a.job, tokens_seen=a.tokens_seen, tag=tag,
                          layout=Layout(tp=tp, pp=pp, dp=dp, world_size=a.world_size))
    options: dict[str, Any] = {}
    if a.store.startswith("s3://"):
        for opt, val in (("multipart_threshold", a.threshold_mib),
                         ("multipart_chunksize", a.chunk_mib)):
            if val:
                options[opt] = val << 20
        if a.concurrency:
            options["max_concurrency"] = a.concurrency
        if a.max_bandwidth_mib:
            options["max_bandwidth"] = int(a.max_bandwidth_mib * (1 << 20))
    try:
        storage = open_storage(a.store, **options)
        write_marker(a.dir, a.step, a.rank, "pending", files, meta)
        upload_rank_files(storage, a.step, a.rank, a.dir, files)
        write_marker(a.dir, a.step, a.rank, "uploaded", files, meta)
        if a.commit:
            manifest = commit_checkpoint(storage, a.step, a.world_size, meta, a.commit_timeout)
            save_local_manifest(Path(a.dir), manifest)
            write_marker(a.dir, a.step, a.rank, "committed", files, meta)
    except Ds3dError as e:
        write_marker(a.dir, a.step, a.rank, "failed", files, meta, error=str(e))
        print(f"upload of step {a.step} rank {a.rank} failed: {e}", file=sys.stderr)
        return 1
    print(f"step {a.step} rank {a.rank}: {len(files)} files uploaded"
          + (", committed" if a.commit else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
