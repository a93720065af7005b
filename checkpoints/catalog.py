"""What checkpoints a job has, which one to restore from, and which to delete.

The catalog reads the store (manifests, parts, file listing) and the local tier (DeepSpeed's tag
folders and ds3d's markers) and never trusts anything but a manifest whose files are all there:
a step without MANIFEST is `uploading` (or an abandoned partial upload) and is never restored;
a manifest whose files are missing, short, or fail their sha256 is `corrupt` and is skipped
with a `checkpoint_skipped` log line and, through `on_skip`, a report record the daemon turns
into an event, a metric and an index row, falling back to the next older one. A manifest
that names another job's id (identity.py) is `foreign`: never restored, never deleted.
"""

from __future__ import annotations

import builtins
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Literal

import structlog
from pydantic import ValidationError

from . import layout
from .deepspeed_latest import refresh_local_latest
from .errors import (
    CheckpointError,
    Ds3dError,
    NotFoundError,
    StateError,
    TransientStorageError,
)
from .identity import ForeignPrefixError, manifest_is_mine
from .manifest import (
    FileEntry,
    Manifest,
    PartManifest,
    hash_file,
    save_local_manifest,
    size_problems,
)
from .retention import plan_retention
from .storage import Storage
from .upload import read_marker

log = structlog.get_logger("ds3d.checkpoints.catalog")

_TAG_RE = re.compile(r"^global_step(\d+)$")
_STEP_DIR_RE = re.compile(r"^step-(\d{8,})$")


class CkptState(StrEnum):
    LOCAL = "local"            # only in the local tier (not uploaded, or its upload failed)
    UPLOADING = "uploading"    # some objects in the store, no MANIFEST yet (or never: a crash)
    COMMITTED = "committed"    # MANIFEST present and every file present with its size
    CORRUPT = "corrupt"        # MANIFEST unreadable, or files missing / of the wrong size
    FOREIGN = "foreign"        # MANIFEST names another job's id: not this job's to load or delete


@dataclass
class CheckpointInfo:
    step: int
    state: CkptState
    size: int
    time: float | None
    in_store: bool
    in_local: bool
    manifest: Manifest | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class RetentionResult:
    """What retention did: steps deleted, and the steps whose cleanup failed with the error
    (each one is reported on its own; it changes no other checkpoint)."""

    deleted: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)


@dataclass
class SweepResult:
    """Leftovers removed by `Catalog.sweep`: uncommitted steps, temporary files, multipart
    uploads, and what could not be removed (key or step -> error)."""

    steps: list[int] = field(default_factory=list)
    temporaries: list[str] = field(default_factory=list)
    uploads: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.steps or self.temporaries or self.uploads or self.failed)


# (step, cause, detail) of a checkpoint a restore passed over
SkipHandler = Callable[[int, str, str], None]


@dataclass(frozen=True)
class Restorable:
    step: int
    manifest: Manifest
    local_dir: Path
    source: Literal["local", "downloaded"]


class Catalog:
    def __init__(self, storage: Storage | None, local_dir: str | Path | None, *,
                 job_id: str | None = None, on_skip: SkipHandler | None = None) -> None:
        """`job_id`: this job's id; checkpoints of other ids are neither restored nor deleted
        (None: a bare catalog for inspection, which refuses nothing). `on_skip` hears of every
        checkpoint a restore passes over."""
        if storage is None and local_dir is None:
            raise ValueError("a catalog needs a store, a local folder, or both")
        self.storage = storage
        self.local_dir = Path(local_dir) if local_dir is not None else None
        self.job_id = job_id
        self.on_skip = on_skip

    # -- listing ----------------------------------------------------------------------------

    def _store_objects(self) -> dict[int, dict[str, int]]:
        by_step: dict[int, dict[str, int]] = {}
        if self.storage is None:
            return by_step
        for obj in self.storage.list(layout.CKPT_ROOT):
            step = layout.step_of_key(obj.key)
            if step is not None:
                by_step.setdefault(step, {})[obj.key] = obj.size
        return by_step

    def load_manifest(self, step: int, local_only: bool = False) -> Manifest:
        """The committed manifest of a step (store first, else the local copy). Raises
        NotFoundError when there is none, CheckpointError when it is unreadable."""
        try:
            if self.storage is None or local_only:
                raise NotFoundError("no store")
            data = self.storage.get_bytes(layout.manifest_key(step))
        except NotFoundError:
            if self.local_dir is None:
                raise NotFoundError(f"no committed checkpoint at step {step}") from None
            path = layout.local_manifest_path(self.local_dir, step)
            if not path.is_file():
                raise NotFoundError(f"no committed checkpoint at step {step}") from None
            data = path.read_bytes()
        try:
            manifest = Manifest.from_json(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise CheckpointError(f"step {step}: MANIFEST is unreadable ({e.error_count()} "
                                  f"errors, first: {where}: {first['msg'][:200]}); the "
                                  "checkpoint is corrupt") from None
        if manifest.step != step:
            raise CheckpointError(f"step {step}: its MANIFEST says step {manifest.step}; the "
                                  "checkpoint is corrupt")
        return manifest

    def _local_steps(self) -> dict[int, float]:
        """Steps with something in the local tier -> newest modification time."""
        out: dict[int, float] = {}
        if self.local_dir is None or not self.local_dir.is_dir():
            return out
        for entry in self.local_dir.iterdir():
            if (m := _TAG_RE.match(entry.name)) and (st := _stat(entry)):
                out[int(m.group(1))] = max(out.get(int(m.group(1)), 0.0), st.st_mtime)
        state = self.local_dir / layout.LOCAL_STATE_DIR
        if state.is_dir():
            for entry in state.iterdir():
                if (m := _STEP_DIR_RE.match(entry.name)) and (st := _stat(entry)):
                    out[int(m.group(1))] = max(out.get(int(m.group(1)), 0.0), st.st_mtime)
        return out

    def _local_size(self, step: int) -> int:
        assert self.local_dir is not None
        total = 0
        for dirpath, _dirs, names in os.walk(self.local_dir / self._local_tag(step)):
            total += sum(st.st_size for n in names if (st := _stat(Path(dirpath) / n)))
        return total

    def _local_tag(self, step: int) -> str:
        """The tag folder of a local step (from a marker's metadata, else DeepSpeed's default)."""
        if self.local_dir is not None:
            for marker in layout.local_state_dir(self.local_dir, step).glob("rank-*.json"):
                rec = read_marker(marker)
                if rec and rec.get("meta"):
                    return str(rec["meta"]["tag"])
        return layout.default_tag(step)

    def list(self) -> list[CheckpointInfo]:
        """Every step found in the store or the local tier, ascending, with its state."""
        store = self._store_objects()
        local = self._local_steps()
        out = []
        for step in sorted(set(store) | set(local)):
            objects = store.get(step, {})
            info = CheckpointInfo(step, CkptState.LOCAL, 0, local.get(step), bool(objects),
                                  step in local)
            if layout.manifest_key(step) in objects:
                try:
                    info.manifest = self.load_manifest(step)
                except CheckpointError as e:
                    info.state, info.problems = CkptState.CORRUPT, [str(e)]
                else:
                    if not self._mine(info.manifest):
                        info.state, info.problems = CkptState.FOREIGN, [self._whose(info.manifest)]
                        info.size, info.time = info.manifest.total_size, info.manifest.created
                        out.append(info)
                        continue
                    info.problems = size_problems(step, info.manifest, objects)
                    info.state = CkptState.CORRUPT if info.problems else CkptState.COMMITTED
                    info.size, info.time = info.manifest.total_size, info.manifest.created
            elif objects:
                info.state = CkptState.UPLOADING
                info.size = sum(s for k, s in objects.items() if "/files/" in k)
            if info.state in (CkptState.LOCAL, CkptState.UPLOADING) and step in local:
                info.size = max(info.size, self._local_size(step))
            out.append(info)
        return out

    # -- verification ---------------------------------------------------------------------

    def verify(self, step: int, checksums: bool = False) -> builtins.list[str]:
        """Problems of a committed checkpoint in the store (empty = good). Sizes come from one
        listing (no download); `checksums` downloads each file to a scratch folder and hashes it."""
        if self.storage is None:
            raise StateError("verify needs a store")
        manifest = self.load_manifest(step)
        objects = {o.key: o.size for o in self.storage.list(layout.step_prefix(step))}
        problems = size_problems(step, manifest, objects) + \
            self._parts_problems(step, manifest, objects)
        if checksums and not problems:
            scratch = self._scratch(step, "verify")
            try:
                for entry in manifest.files:
                    tmp = scratch / "f"
                    self.storage.get_file(layout.file_key(step, entry.path), tmp)
                    if hash_file(tmp) != entry.sha256:
                        problems.append(f"{entry.path}: sha256 differs from the manifest")
                    tmp.unlink()
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        return problems

    def _parts_problems(self, step: int, manifest: Manifest,
                        objects: dict[str, int]) -> builtins.list[str]:
        """A MANIFEST is complete when it lists every file of every rank's part (the parts
        it was merged from stay beside it): an entry missing from it would pass every size
        and hash check and fail only inside DeepSpeed's load, on every restart. One read per
        rank, in parallel; at restore and on `--verify`, not in listings."""
        assert self.storage is not None
        storage = self.storage
        keys = {r: k for k in objects if (r := layout.rank_of_part_key(k)) is not None}
        missing = sorted(set(range(manifest.layout.world_size)) - set(keys))
        if missing:
            return [f"no part of rank(s) {', '.join(map(str, missing[:8]))} beside the MANIFEST"]

        def read(key: str) -> PartManifest | None:
            try:
                return PartManifest.model_validate_json(storage.get_bytes(key))
            except (NotFoundError, ValidationError):
                return None

        listed = {f.path: f for f in manifest.files}
        problems = []
        ranks = sorted(r for r in keys if r < manifest.layout.world_size)
        with ThreadPoolExecutor(max_workers=min(16, len(ranks)) or 1) as pool:
            for rank, part in zip(ranks, pool.map(read, (keys[r] for r in ranks)), strict=True):
                if part is None or part.step != step:
                    problems.append(f"the part of rank {rank} is unreadable or of another step")
                    continue
                for entry in part.files:
                    if entry.path not in listed:
                        problems.append(f"{entry.path} (in rank {rank}'s part) is not in the "
                                        "MANIFEST")
                    elif not listed[entry.path].same_bytes(entry):
                        problems.append(f"{entry.path}: the MANIFEST and rank {rank}'s part "
                                        "disagree on its size or sha256")
        return problems

    def _scratch(self, step: int, what: str) -> Path:
        base = (self.local_dir / layout.LOCAL_STATE_DIR if self.local_dir is not None
                else Path(os.environ.get("TMPDIR", "/tmp")))
        path = base / f"{what}-{layout.step_name(step)}-{os.getpid()}-{time.monotonic_ns()}"
        path.mkdir(parents=True)
        return path

    # -- restore ----------------------------------------------------------------------------

    def newest_restorable(self, *, checksums: bool = True, download: bool = True,
                          paths: set[str] | None = None,
                          only_step: int | None = None,
                          newer_than: int = -1,
                          uncommit_corrupt: bool = False) -> Restorable | None:
        """The newest committed checkpoint whose files verify, made available locally.

        A local copy that matches the manifest (sha256 when `checksums`) is used as is;
        otherwise the files that differ are downloaded to a scratch folder, checked against
        their sha256, and only then moved into the local tier. `paths` limits the files this
        node needs (its own ranks' shards). Corrupt or partial checkpoints are skipped with a
        logged event. When the store is unreachable, the local copies of committed manifests
        are used instead. `only_step` restricts the choice to that step (a rollback);
        `newer_than` to later steps (one already at hand locally: engine_io.plan_restore).
        `uncommit_corrupt` (the training restore only, never a read-only caller): a step whose
        stored object fails the sha256 its MANIFEST recorded loses its MANIFEST (see
        `_uncommit`)."""
        try:
            store = self._store_objects()
            candidates = sorted((s for s, objs in store.items()
                                 if layout.manifest_key(s) in objs), reverse=True)
            if self.storage is None:
                candidates = self._local_manifest_steps()
        except TransientStorageError as e:
            log.warning("checkpoint_store_unreachable", cause="outage", detail=str(e))
            store, candidates = {}, self._local_manifest_steps()
        if only_step is not None:
            candidates = [s for s in candidates if s == only_step]
        candidates = [s for s in candidates if s > newer_than]
        for step in candidates:
            try:
                manifest = self.load_manifest(step, local_only=step not in store)
            except (CheckpointError, NotFoundError) as e:
                self._skip(step, "unreadable", str(e))
                continue
            if not self._mine(manifest):
                self._skip(step, "foreign", self._whose(manifest))
                continue
            if step in store and (problems := size_problems(step, manifest, store[step]) or
                                  self._parts_problems(step, manifest, store[step])):
                self._skip(step, "incomplete", "; ".join(problems[:5]))
                continue
            found = self._materialize(manifest, checksums, download and step in store, paths,
                                      uncommit_corrupt)
            if found is not None:
                return found
        return None

    def _local_manifest_steps(self) -> builtins.list[int]:
        if self.local_dir is None:
            return []
        state = self.local_dir / layout.LOCAL_STATE_DIR
        steps = [int(m.group(1)) for p in state.glob(f"step-*/{layout.MANIFEST_NAME}")
                 if (m := _STEP_DIR_RE.match(p.parent.name))]
        return sorted(steps, reverse=True)

    def _materialize(self, manifest: Manifest, checksums: bool, download: bool,
                     paths: set[str] | None, uncommit_corrupt: bool = False
                     ) -> Restorable | None:
        step = manifest.step
        if self.local_dir is None:
            raise StateError("restoring needs a local folder to restore into")
        wanted = [e for e in manifest.files if paths is None or e.path in paths]
        stale = [e for e in wanted if not _local_matches(self.local_dir / e.path, e, checksums)]
        if not stale:
            save_local_manifest(self.local_dir, manifest)
            return Restorable(step, manifest, self.local_dir, "local")
        if not download or self.storage is None:
            self._skip(step, "not_local", f"{len(stale)} files missing or differing locally "
                  "and no download possible")
            return None
        scratch = self._scratch(step, "download")
        try:
            for i, entry in enumerate(stale):
                tmp = scratch / f"{i:06d}"
                try:
                    self.storage.get_file(layout.file_key(step, entry.path), tmp)
                except NotFoundError:
                    self._skip(step, "incomplete", f"{entry.path}: missing in the store")
                    return None
                if not _local_matches(tmp, entry, checksums=True):
                    why = f"{entry.path}: size or sha256 of the stored object differs from " \
                          "the manifest"
                    if uncommit_corrupt:
                        why += self._uncommit(manifest)
                    self._skip(step, "corrupt", why)
                    return None
            for i, entry in enumerate(stale):
                dest = self.local_dir / entry.path
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(scratch / f"{i:06d}", dest)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        save_local_manifest(self.local_dir, manifest)
        log.info("checkpoint_downloaded", step=step, files=len(stale),
                 bytes=sum(e.size for e in stale))
        return Restorable(step, manifest, self.local_dir, "downloaded")

    def _uncommit(self, manifest: Manifest) -> str:
        """A committed checkpoint whose stored bytes rotted (the store's copy fails its
        recorded sha256) can never be restored. Its MANIFEST is deleted, as the uploader deletes
        a dead one (upload.live_manifest): every later restore would download it again to find
        the same, and the step trained again could never commit ("already committed with other
        files", retried for ever, a pause or stop waiting on the store). Its files stay until
        retention's sweep. Returns what to add to the skip's detail."""
        assert self.storage is not None
        key = layout.manifest_key(manifest.step)
        try:
            current = Manifest.from_json(self.storage.get_bytes(key))
            if current != manifest:
                return ""  # committed again meanwhile (by a newer save): not ours to delete
            self.storage.delete([key])
        except (Ds3dError, ValidationError) as e:
            return f" (its MANIFEST could not be deleted: {e})"
        return "; its MANIFEST is deleted (uncommitted), so the step can be saved again"

    # -- deletion ---------------------------------------------------------------------------

    def delete(self, step: int, *, store: bool = True, local: bool = True,
               force: bool = False) -> None:
        """Deletes a checkpoint. In the store the MANIFEST goes first, so a half-finished delete
        leaves an uncommitted step, never a committed one with files missing. The local copy of
        a step whose upload is unfinished is kept unless `force` (it is the only copy). A step
        whose manifest or parts name another job's id is refused (ForeignPrefixError), even
        with `force`."""
        if store and self.storage is not None:
            self._check_deletable(step)
            keys = [o.key for o in self.storage.list(layout.step_prefix(step))]
            self.storage.delete([layout.manifest_key(step)])
            self.storage.delete(k for k in keys if k != layout.manifest_key(step))
            # parts of its unfinished multipart uploads cost storage until aborted
            abort = getattr(self.storage, "abort_incomplete_uploads", None)
            if abort is not None:
                abort(layout.step_prefix(step))
        if local and self.local_dir is not None:
            committed = self.storage is None or not self._unfinished_local(step)
            if not committed and not force:
                raise StateError(f"step {step}: its upload is unfinished and the local copy may "
                                 "be the only one; pass force to delete it anyway")
            shutil.rmtree(self.local_dir / self._local_tag(step), ignore_errors=True)
            shutil.rmtree(layout.local_state_dir(self.local_dir, step), ignore_errors=True)
            refresh_local_latest(self.local_dir)
        log.info("checkpoint_deleted", step=step, store=store, local=local)

    def _unfinished_local(self, step: int) -> bool:
        assert self.local_dir is not None
        for marker in layout.local_state_dir(self.local_dir, step).glob("rank-*.json"):
            rec = read_marker(marker)
            if rec and rec.get("state") in ("pending", "failed"):
                return True
        return False

    def apply_retention(self, keep_last: int, keep_every: int = 0,
                        protect: Iterable[int] = ()) -> RetentionResult:
        """Deletes this job's committed checkpoints superseded per `plan_retention`. Uploading,
        local-only, corrupt and foreign steps are never touched here. Each step is deleted on
        its own: one that fails is recorded in the result and the others still go; nothing
        here changes the state of any other checkpoint. The local copies go too (force): a
        committed step's store copy is complete, whatever another rank's marker says."""
        committed = [c.step for c in self.list() if c.state is CkptState.COMMITTED]
        result = RetentionResult()
        for step in plan_retention(committed, keep_last, keep_every, protect):
            try:
                self.delete(step, force=True)
            except (Ds3dError, OSError) as e:
                log.warning("checkpoint_cleanup_failed", step=step, detail=str(e))
                result.failed[step] = str(e)
            else:
                result.deleted.append(step)
        return result

    def sweep(self, grace_s: float, now: float | None = None) -> SweepResult:
        """Removes what unfinished saves left in the store once it is older than `grace_s`:
        steps without a MANIFEST that are older than the newest committed step (a newer one may
        still be uploading, however slowly), temporary files of interrupted writes (file
        store), and unfinished multipart uploads (S3). Only this job's: a step with another
        job's parts is left alone. Errors are collected, not raised."""
        if self.storage is None:
            return SweepResult()
        cutoff = (time.time() if now is None else now) - grace_s
        result = SweepResult()
        objects: dict[int, list[tuple[str, float]]] = {}
        for obj in self.storage.list(layout.CKPT_ROOT):
            step = layout.step_of_key(obj.key)
            if step is not None:
                objects.setdefault(step, []).append((obj.key, obj.mtime))
        committed = [s for s, objs in objects.items()
                     if any(k == layout.manifest_key(s) for k, _ in objs)]
        newest = max(committed, default=-1)
        for step, objs in sorted(objects.items()):
            if step >= newest or step in committed or max(t for _, t in objs) >= cutoff:
                continue
            try:
                self._check_deletable(step)
                self.storage.delete(k for k, _ in objs)
            except (Ds3dError, OSError) as e:
                result.failed[layout.step_prefix(step)] = str(e)
            else:
                result.steps.append(step)
        sweepers = (("temporaries", "sweep_temporaries"), ("uploads", "abort_stale_uploads"))
        for what, method in sweepers:
            fn = getattr(self.storage, method, None)
            if fn is None:
                continue
            try:
                getattr(result, what).extend(fn(layout.CKPT_ROOT, cutoff))
            except (Ds3dError, OSError) as e:
                result.failed[what] = str(e)
        if result:
            log.info("checkpoint_leftovers_swept", steps=result.steps,
                     temporaries=len(result.temporaries), uploads=len(result.uploads),
                     failed=result.failed)
        return result

    # -- identity ---------------------------------------------------------------------------

    def _mine(self, manifest: Manifest) -> bool:
        return manifest_is_mine(manifest.job_id, self.job_id)

    def _whose(self, manifest: Manifest) -> str:
        return (f"its MANIFEST names job {manifest.job!r} (id {manifest.job_id}), not this job "
                f"(id {self.job_id})")

    def _check_deletable(self, step: int) -> None:
        """ForeignPrefixError if the step's manifest or a part names another job's id."""
        if self.job_id is None or self.storage is None:
            return
        try:
            manifest = Manifest.from_json(self.storage.get_bytes(layout.manifest_key(step)))
        except (NotFoundError, ValidationError):
            manifest = None
        if manifest is not None and not self._mine(manifest):
            raise ForeignPrefixError(f"step {step} is not deleted: {self._whose(manifest)}")
        for obj in self.storage.list(layout.parts_prefix(step)):
            try:
                part = PartManifest.model_validate_json(self.storage.get_bytes(obj.key))
            except (NotFoundError, ValidationError):
                continue
            if not manifest_is_mine(part.job_id, self.job_id):
                raise ForeignPrefixError(f"step {step} is not deleted: rank {part.rank}'s part "
                                         f"was written by job id {part.job_id}, not this job "
                                         f"(id {self.job_id})")

    def _skip(self, step: int, cause: str, detail: str) -> None:
        log.warning("checkpoint_skipped", step=step, cause=cause, detail=detail)
        if self.on_skip is not None:
            self.on_skip(step, cause, detail)


def _local_matches(path: Path, entry: FileEntry, checksums: bool) -> bool:
    try:
        if path.stat().st_size != entry.size:
            return False
    except FileNotFoundError:
        return False
    return not checksums or hash_file(path) == entry.sha256


def _stat(path: Path) -> os.stat_result | None:
    """The file's stat, None once it is gone: the local tier is shared by the node's ranks,
    and another rank's retention or rollback may delete a step while this one lists it (a CI
    run failed a spike drill on a FileNotFoundError here)."""
    try:
        return path.stat()
    except FileNotFoundError:
        return None
