"""Restore's one pass over a rank's checkpoint files: read in parallel, hashed as they stream.

The sha256 of every file, and of each of its 64 MiB pieces, was computed once, when its rank
wrote it (local_complete.py's record, manifest.hash_file_chunks). A restore used to hash the
whole local copy (20 s for the 19.8 GB `gpt1b` state on an H200) and then have `torch.load`
read it all again. Here each file is read once, by several threads at once (`os.preadv`, which
releases the GIL), into host memory of its own size, and each reader checks the hash of the
piece it read (hashlib releases the GIL too): the check costs no extra pass and runs on as many
cores as there are readers. (Entries of older versions have only the whole-file sha256: a
hasher thread per file follows the readers piece by piece, one core per file.) It runs in the
background while the engine is built; `wait()` says which files do not match their recorded
size and sha256. DeepSpeed's `load_checkpoint` is then served from these buffers
(`load_buffer`, used by snapshot.SnapshotCheckpointEngine), with no second read of the files:
the tensors are views of the verified bytes. With a `Destination` (on a GPU: the snapshot
arena, snapshot.ArenaLoan) the files are read into one buffer it gives, each at a 4 KiB-aligned
offset, instead of into buffers of their own.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast

import torch

from .host_memory import anonymous_buffer
from .manifest import FileEntry

CHUNK = 64 << 20  # bytes one reader reads at a time
READERS = max(4, min(16, os.cpu_count() or 4))
ALIGN = 4096  # each file's offset in a destination buffer


class Destination(Protocol):
    """Where a read may put its files instead of buffers of their own (snapshot.ArenaLoan)."""

    def take(self, needed: int) -> memoryview | None:
        """One buffer of at least `needed` bytes, or None (each file gets its own)."""

    def done(self) -> None:
        """The read is over (whatever its outcome): nothing writes into the buffer any more."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ReadResult:
    buffers: dict[str, memoryview]  # absolute normalised path -> its verified bytes
    bad: dict[str, str]  # relative path -> what was wrong (missing, short, sha256)
    nbytes: int
    seconds: float
    placed: frozenset[str] = frozenset()  # paths of `buffers` that lie in the Destination

    @property
    def ok(self) -> bool:
        return not self.bad


class ReadAhead:
    """Reads `entries` (relative to `root`) into host memory in the background, each file
    hashed while it streams; `wait()` returns the buffers of the files that match their record
    and names those that do not."""

    def __init__(self, root: str | Path, entries: list[FileEntry], readers: int = READERS,
                 chunk: int = CHUNK, into: Destination | None = None) -> None:
        self.root, self.entries = Path(root), list(entries)
        self.readers, self.chunk = max(1, readers), max(1 << 20, chunk)
        self.into = into
        self._result: ReadResult | None = None
        self._thread = threading.Thread(target=self._run, name="ckpt-read-ahead", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> ReadAhead:
        self._thread.start()
        return self

    def wait(self) -> ReadResult:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _run(self) -> None:
        import time

        t0 = time.perf_counter()
        try:
            buffers: dict[str, memoryview] = {}
            bad: dict[str, str] = {}
            whole = self.into.take(sum(_aligned(e.size) for e in self.entries)) \
                if self.into is not None else None
            offset = 0  # the next file's place in `whole`
            placed: set[str] = set()
            with ThreadPoolExecutor(self.readers, thread_name_prefix="ckpt-read") as pool:
                files: list[_Hasher | _ChunkChecked] = []
                for e in self.entries:
                    path = self.root / e.path
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except OSError as err:
                        bad[e.path] = f"cannot open: {err.strerror}"
                        continue
                    size = os.fstat(fd).st_size
                    if size != e.size:
                        os.close(fd)
                        bad[e.path] = f"size {size} bytes, recorded {e.size}"
                        continue
                    if whole is not None and offset + size <= len(whole):
                        view, offset = whole[offset:offset + size], _aligned(offset + size)
                        placed.add(os.path.normpath(os.path.abspath(path)))
                    else:
                        view = memoryview(anonymous_buffer(size)) if size else memoryview(b"")
                    if e.chunk_bytes:  # recorded per piece: each reader checks its own
                        chunks = _pieces(size, e.chunk_bytes)
                        checks = [pool.submit(_read_checked, fd, view[off:off + n], off, want)
                                  for (off, n), want in zip(chunks, e.chunk_sha256, strict=True)]
                        files.append(_ChunkChecked(e, path, fd, view, checks))
                        continue
                    chunks = _pieces(size, self.chunk)
                    reads = [pool.submit(_pread_full, fd, view[off:off + n], off)
                             for off, n in chunks]
                    hasher = _Hasher(e, path, fd, view, chunks, reads)
                    files.append(hasher)
                    hasher.start()
                for f in files:
                    problem = f.finish()
                    if problem:
                        bad[f.entry.path] = problem
                    else:
                        buffers[os.path.normpath(os.path.abspath(f.path))] = f.view
            self._result = ReadResult(buffers, bad, sum(len(b) for b in buffers.values()),
                                      time.perf_counter() - t0,
                                      frozenset(placed & set(buffers)))
        except BaseException as e:  # raised by wait(), on the caller's thread
            self._error = e
        finally:
            if self.into is not None:
                self.into.done()


def _pieces(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, size - off)) for off in range(0, size, chunk)]


def _read_checked(fd: int, view: memoryview, offset: int, sha256: str) -> str | None:
    """Reads one recorded piece and checks its hash, on the reader's own thread."""
    try:
        _pread_full(fd, view, offset)
    except OSError as e:
        return f"read failed: {e}"
    if hashlib.sha256(view).hexdigest() != sha256:
        return f"sha256 of the piece at byte {offset} differs from the one recorded at save"
    return None


class _ChunkChecked:
    """One file whose pieces are read and checked by the pool (entries with chunk hashes)."""

    def __init__(self, entry: FileEntry, path: Path, fd: int, view: memoryview,
                 checks: list[Future[str | None]]) -> None:
        self.entry, self.path, self.fd, self.view, self.checks = entry, path, fd, view, checks

    def finish(self) -> str | None:
        try:
            return next((p for p in (c.result() for c in self.checks) if p), None)
        finally:
            os.close(self.fd)


class _Hasher(threading.Thread):
    """Hashes one file's chunks in order as the readers finish them (entries recorded with one
    sha256 for the whole file, by versions before chunk hashes)."""

    def __init__(self, entry: FileEntry, path: Path, fd: int, view: memoryview,
                 chunks: list[tuple[int, int]], reads: list[Future[None]]) -> None:
        super().__init__(name="ckpt-hash", daemon=True)
        self.entry, self.path, self.fd, self.view = entry, path, fd, view
        self.chunks, self.reads = chunks, reads
        self.problem: str | None = None

    def run(self) -> None:
        h = hashlib.sha256()
        try:
            for (off, n), read in zip(self.chunks, self.reads, strict=True):
                read.result()
                h.update(self.view[off:off + n])
            if h.hexdigest() != self.entry.sha256:
                self.problem = "sha256 differs from the one recorded at save"
        except OSError as e:
            self.problem = f"read failed: {e}"
        finally:
            os.close(self.fd)

    def finish(self) -> str | None:
        self.join()
        return self.problem


def _pread_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"file ended {len(view) - done} bytes early (changed while read?)")
        done += n


class _BufferFile:
    """A read-only file over a buffer, for torch's zip reader (reads copy only what is asked:
    the zip directory and the pickle; tensor bytes come from the buffer itself)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else len(self.view) + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        data = bytes(self.view[self.pos:end])
        self.pos = end
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def load_buffer(view: memoryview, map_location: Any = None,
                users: list[Any] | None = None) -> Any:
    """What `torch.load(path, map_location, weights_only=False)` gives for a file whose bytes
    are `view`, with every tensor's storage a view of `view` (no copy; torch's own mmap path,
    given our buffer instead of a mapped file). Falls back to a copying `torch.load` where
    torch's private loader has another shape. `users`: gets a weak reference to the storage
    every loaded tensor shares (`.expired()` once no tensor uses `view`'s bytes)."""
    import torch.serialization as ser
    from torch.multiprocessing.reductions import StorageWeakRef

    f = cast(IO[bytes], _BufferFile(view))
    try:
        storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage() if len(view) \
            else None
        if storage is not None and users is not None:
            users.append(StorageWeakRef(storage))  # type: ignore[no-untyped-call]
        with ser._open_zipfile_reader(f) as zf:
            return ser._load(zf, map_location, pickle,  # type: ignore[no-untyped-call]
                             overall_storage=storage, encoding="utf-8")
    except (AttributeError, TypeError):
        f.seek(0)
        return torch.load(f, map_location=map_location, weights_only=False)
