"""The newest save's host copy in node memory (/dev/shm), so that it outlives the worker.

A crash loses the worker process and with it the snapshot arena (snapshot.py), although the
newest save's host copy was complete: the restart then resumes from the newest step that is
local-complete on disk, which can be several intervals older while writes and hashes of a
large state (tens of seconds) queue behind each other. Here the arena is a file in a tmpfs
(`/dev/shm/ds3d-<job id>/rank-<R>.arena`, a MAP_SHARED mapping, page-locked with CUDA in
pieces as the anonymous one is), so its pages stay in RAM when the process dies, and a
restarted worker of the same job, rank and layout maps it back (`NodeArena.adopt`).
With memory-only snapshots (`checkpoint.memory_interval`, snapshot.py) a rank has two arena
slots, each its own file and marker: slot 0 `rank-<R>.arena` / `.held`, slot 1
`rank-<R>-1.arena` / `rank-<R>-1.held` (twice the state's size in RAM); a restart maps back
every slot with a valid marker and restores the newest step that every rank holds (engine_io).

Validity marker (`rank-<R>.held`, one per slot): the held save's skeleton (every file's dict,
each tensor as (offset, dtype, shape, stride) in the arena), its tag and step, the save's
manifest metadata and the layout fingerprint (job id, rank, world size, tp/pp/dp, model hash),
the arena file's identity (inode, size) and whether the save's files were written too
(`durable`; false for a memory-only snapshot). It is written atomically (temp file + rename)
only once every host copy of the save is complete (device synchronised:
`SnapshotCheckpointEngine.save`), and removed at the `create()` of the next save into the same
slot, before any byte of that arena is overwritten, mirroring the in-process forgetting of that
slot's snapshot. A crash mid-copy therefore leaves no marker, and a marker always describes
exactly the bytes its save copied: "complete and verified, or ignored".

No checksum is taken of the arena: the bytes never leave RAM (tmpfs, no medium to rot, the
same DRAM/ECC the in-process rollback trusts), the only writer is this job's rank (folder mode
0700, removed marker before any write), and a hash of ~20 GB would cost several seconds at
every save, on the path this exists to shorten. The marker's fingerprint and the arena's inode
and size stop a marker from being used with an arena of another start, job or layout. (The
marker is a pickle, as DeepSpeed's own checkpoint files are: only this user can write the
folder.)

Room: the arena goes to /dev/shm only when that is a tmpfs with free space and MemAvailable
of at least the arena plus a margin (a container's 64 MB /dev/shm just falls back to the
anonymous arena, one log line saying why); the file is fully allocated up front
(posix_fallocate), so a tmpfs that fills later cannot SIGBUS a save. With two slots, a node
with room for one arena but not two turns memory-only snapshots off for the run (engine_io:
one log line and a `memory_snapshots_off` record) and keeps the one slot here.

Cleanup (it is RAM): the worker removes its files on a clean exit (`CheckpointManager.
release_node_memory`); ds3dd removes a job's folder when the job ends or is deleted, and at
its start for the jobs it knows that no longer run (`remove_job_folder`); a start with another
layout replaces this rank's files and removes those of ranks beyond its world size (every
slot's), and a start without memory-only snapshots removes this rank's second slot. Without
the daemon, a crash that is never restarted leaves the folder until the job's next start (its
same run directory, so the same job id) or a reboot.
"""

from __future__ import annotations

import mmap
import os
import pickle
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("ds3d.checkpoints.node_memory")

ROOT_ENV = "DS3D_NODE_MEMORY_ROOT"  # another tmpfs than /dev/shm (set for ds3dd and workers)
MIN_MARGIN = 64 << 20


def default_root() -> Path:
    """/dev/shm, or the folder DS3D_NODE_MEMORY_ROOT names."""
    return Path(os.environ.get(ROOT_ENV) or "/dev/shm")


def margin(nbytes: int) -> int:
    """Left free in the tmpfs and in MemAvailable beyond an arena of `nbytes`: 1/16 of it, at
    least 64 MiB (so a container's 64 MB /dev/shm never takes one)."""
    return max(MIN_MARGIN, nbytes // 16)


FORMAT = 1
_FOLDER_PREFIX = "ds3d-"
MAX_SLOTS = 2  # arena slots per rank: one, or two with memory-only snapshots (snapshot.py)


@dataclass(frozen=True)
class Fingerprint:
    """What must be equal for a held snapshot to restore this rank."""

    job_id: str
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    model_hash: str


@dataclass(frozen=True)
class Held:
    """A marker read back, its tensors views into the adopted arena."""

    tag: str
    step: int
    meta: str  # the save's CheckpointMeta as JSON (engine_io reads it)
    files: dict[str, Any]  # file name (DeepSpeed's) -> its state
    durable: bool = True  # its files were written too (False: a memory-only snapshot)


def job_folder(job_id: str, root: Path | None = None) -> Path:
    """The job's folder: named by its unique id (identity.py), so it cannot alias another job."""
    if not job_id or "/" in job_id or job_id in (".", ".."):
        raise ValueError(f"job id {job_id!r} cannot name a folder")
    return (root or default_root()) / f"{_FOLDER_PREFIX}{job_id}"


def remove_job_folder(job_id: str | None, root: Path | None = None) -> bool:
    """Removes a job's node-memory folder (ds3dd: the job ended; it is RAM), saying so in the
    log; True when there was one. No job id (a job that never started a worker): nothing."""
    if not job_id:
        return False
    folder = job_folder(job_id, root)
    if not folder.exists():
        return False
    shutil.rmtree(folder, ignore_errors=True)
    log.info("node memory released", job_id=job_id, folder=str(folder))
    return True


def no_room(nbytes: int, root: Path | None = None, reusable: int = 0) -> str | None:
    """Why an arena of `nbytes` cannot go to `root` (None: it can): `root` must be a tmpfs
    with that much free space plus `margin`, and MemAvailable must allow it too. `reusable`:
    bytes of this rank's existing arena file there, which the new one replaces."""
    root = root or default_root()
    fstype = _fstype(root)
    if fstype != "tmpfs":
        return f"{root} is {'missing' if fstype is None else f'a {fstype}, not a tmpfs'}"
    extra = margin(nbytes)
    need = nbytes - reusable + extra
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    if free < need:
        return (f"{root} has {free / 2**30:.2f} GiB free, the arena needs "
                f"{nbytes / 2**30:.2f} GiB + {extra >> 20} MiB")
    available = _mem_available()
    if available is not None and available < need:
        return (f"MemAvailable is {available / 2**30:.2f} GiB, the arena needs "
                f"{nbytes / 2**30:.2f} GiB + {extra >> 20} MiB")
    return None


class NodeArena:
    """One rank's arena file and validity marker in its job's folder, of one arena slot:
    slot 0 is `rank-<R>.arena` / `.held`, slot k > 0 `rank-<R>-<k>.arena` / `.held` (the
    second slot of memory-only snapshots, snapshot.py)."""

    def __init__(self, fingerprint: Fingerprint, root: Path | None = None,
                 slot: int = 0) -> None:
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"arena slot {slot} is not in 0..{MAX_SLOTS - 1}")
        self.fingerprint, self.slot = fingerprint, slot
        self.folder = job_folder(fingerprint.job_id, root)
        name = f"rank-{fingerprint.rank:05d}" + (f"-{slot}" if slot else "")
        self.arena_path = self.folder / f"{name}.arena"
        self.marker_path = self.folder / f"{name}.held"
        self._identity: tuple[int, int] | None = None  # (inode, size) of the mapped arena
        self._mapped: mmap.mmap | None = None  # that mapping (made or adopted here)

    def create(self, nbytes: int) -> mmap.mmap | None:
        """A fresh arena file of `nbytes`, fully allocated and mapped shared; None (after one
        log line saying why) when there is no room, the caller then uses an anonymous arena.
        Any earlier file of this rank (another layout, or a held copy not adopted) goes."""
        self.forget()
        old = self.arena_path.stat().st_size if self.arena_path.exists() else 0
        why = no_room(nbytes, self.folder.parent, reusable=old)
        if why is None:
            try:
                return self._allocate(nbytes)
            except OSError as e:  # e.g. the tmpfs filled meanwhile, or not ours to write
                self.arena_path.unlink(missing_ok=True)
                why = f"allocating {nbytes} bytes in {self.folder.parent} failed: {e}"
        log.warning("node_memory_unavailable", reason=why, bytes=nbytes,
                    detail="the snapshot arena is anonymous memory: a crash restarts from disk")
        return None

    def _allocate(self, nbytes: int) -> mmap.mmap:
        self.folder.mkdir(mode=0o700, exist_ok=True)
        self.arena_path.unlink(missing_ok=True)
        fd = os.open(self.arena_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # every page now: a full tmpfs cannot SIGBUS a save
            buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        self._identity, self._mapped = (st.st_ino, st.st_size), buf
        log.info("node_memory_arena", path=str(self.arena_path), bytes=nbytes)
        return buf

    def adopt(self) -> tuple[mmap.mmap, Held] | None:
        """This rank's arena and what it holds, when its marker is valid for this rank's
        fingerprint and arena file; else None, and files of another layout or job are
        removed (a marker of another fingerprint, an arena without a marker is kept: `create`
        replaces it)."""
        try:
            with open(self.marker_path, "rb") as fh:
                header = pickle.load(fh)
                if not isinstance(header, dict) or header.get("format") != FORMAT:
                    raise ValueError(f"not a marker of format {FORMAT}")
                if header.get("fingerprint") != asdict(self.fingerprint):
                    log.info("node_memory_other_layout", path=str(self.marker_path),
                             held=header.get("fingerprint"), mine=asdict(self.fingerprint))
                    self.remove()
                    return None
                fd = os.open(self.arena_path, os.O_RDWR)
                try:
                    st = os.fstat(fd)
                    if (st.st_ino, st.st_size) != tuple(header["arena"]):
                        raise ValueError("the marker names another arena file")
                    buf = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED)
                finally:
                    os.close(fd)
                files = _Unpickler(fh, buf).load()
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as e:
            log.warning("node_memory_marker_ignored", path=str(self.marker_path), error=str(e))
            self.forget()
            return None
        self._identity, self._mapped = (st.st_ino, st.st_size), buf
        return buf, Held(str(header["tag"]), int(header["step"]), str(header["meta"]), files,
                         bool(header.get("durable", True)))

    def for_slot(self, slot: int) -> NodeArena:
        """This rank's arena of another slot, in the same folder."""
        return NodeArena(self.fingerprint, self.folder.parent, slot)

    def mark(self, tag: str, step: int, meta: str, files: dict[str, Any],
             arena: mmap.mmap, durable: bool = True) -> bool:
        """Writes the marker for a save whose host copies are complete: `files` (name ->
        state) must hold only tensors carved from `arena`; False, and no marker, otherwise
        (a tensor the arena had no room for lives in this process only). `durable`: the
        save's files are being written too (False: a memory-only snapshot)."""
        if self._identity is None or arena is not self._mapped:
            return False
        base = _address(arena)
        tmp = self.marker_path.with_name(self.marker_path.name + f".tmp{os.getpid()}")
        header = {"format": FORMAT, "fingerprint": asdict(self.fingerprint), "tag": tag,
                  "step": step, "meta": meta, "arena": list(self._identity),
                  "durable": durable}
        try:
            with open(tmp, "wb") as fh:
                pickle.dump(header, fh, protocol=pickle.HIGHEST_PROTOCOL)
                _Pickler(fh, base, len(arena)).dump(files)
            os.replace(tmp, self.marker_path)
        except (_NotInArena, OSError) as e:  # OSError: the folder removed under a live job
            tmp.unlink(missing_ok=True)
            log.warning("node_memory_not_marked", step=step, detail=str(e))
            return False
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return True

    def owns(self, arena: mmap.mmap) -> bool:
        """`arena` is this rank's file, made or adopted here (not an anonymous fallback)."""
        return arena is self._mapped

    def forget(self) -> None:
        """Removes the marker: the arena's bytes are about to change (or were never whole)."""
        self.marker_path.unlink(missing_ok=True)

    def remove(self) -> None:
        """Removes this rank's marker and arena (a mapping of it stays valid until closed)."""
        self.forget()
        self.arena_path.unlink(missing_ok=True)
        self._identity = self._mapped = None
        try:
            self.folder.rmdir()
        except OSError:
            pass  # other ranks' files still there, or gone already

    def remove_slots_from(self, slots: int) -> None:
        """Removes this rank's files of arena slots >= `slots` (a start that uses fewer)."""
        for slot in range(max(slots, 0), MAX_SLOTS):
            self.for_slot(slot).remove()

    def remove_ranks_from(self, world_size: int) -> None:
        """Removes the files of ranks >= `world_size` (a start with a smaller world), every
        slot's."""
        for path in self.folder.glob("rank-*"):
            try:
                rank = int(path.name[5:10])
            except ValueError:
                continue
            if rank >= world_size:
                path.unlink(missing_ok=True)
        try:
            self.folder.rmdir()
        except OSError:
            pass  # files of ranks still in the world, or no folder


class _NotInArena(ValueError):
    pass


def _address(buf: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class _Pickler(pickle.Pickler):
    """Pickles a snapshot's structure with each tensor as its place in the arena."""

    def __init__(self, fh: Any, base: int, size: int) -> None:
        import torch  # here: ds3dd imports this module (remove_job_folder), never torch

        super().__init__(fh, protocol=pickle.HIGHEST_PROTOCOL)
        self.base, self.size = base, size
        self.tensor_type = torch.Tensor

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, self.tensor_type):
            return None
        if obj.numel() == 0:
            return ("t", 0, str(obj.dtype), tuple(obj.shape), tuple(obj.stride()), 0)
        if obj.device.type != "cpu":
            raise _NotInArena(f"a {obj.device} tensor is not in the arena")
        storage = obj.untyped_storage()
        offset = storage.data_ptr() - self.base
        if not 0 <= offset or offset + storage.nbytes() > self.size:
            raise _NotInArena("a tensor of the save lives outside the arena (it had no room)")
        return ("t", offset + obj.storage_offset() * obj.element_size(), str(obj.dtype),
                tuple(obj.shape), tuple(obj.stride()), obj.numel())


class _Unpickler(pickle.Unpickler):
    """The inverse: each tensor a view of the adopted arena (no copy)."""

    def __init__(self, fh: Any, buf: mmap.mmap) -> None:
        super().__init__(fh)
        self.buf = buf

    def persistent_load(self, pid: Any) -> Any:
        import torch

        kind, offset, dtype_name, shape, stride, numel = pid
        if kind != "t":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"unknown dtype {dtype_name!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if numel else 0
        if offset < 0 or offset + span * itemsize > len(self.buf):
            raise pickle.UnpicklingError("a tensor lies outside the arena")
        if span == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self.buf, dtype=dtype, count=span, offset=offset)
        return flat.as_strided(shape, stride)


def _fstype(path: Path) -> str | None:
    """The file system type of the mount `path` lies on (longest mount point), None if absent."""
    try:
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            return None
        best, fstype = "", None
        with open("/proc/self/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, parts[2]
        return fstype
    except OSError:
        return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None

