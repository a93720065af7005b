"""Hashing a checkpoint file while it is written, so a save is verified without a read back.

The local-complete record (local_complete.py) holds each file's sha256 and the sha256 of each
`CHUNK_BYTES` piece. Hashing a file after writing it reads every byte a second time (19.8 GB
per save on an H200); `HashingWriter` sits between `torch.save` and the file instead and feeds
every byte written, in order, to the file's sha256 (one sequential thread) and to its pieces'
hashes (a pool, one task per piece), so the digests equal what `manifest.hash_file_chunks` of
the finished file gives, bit for bit.

Why it can trail the writes: `torch.save` into a file object (PyTorchFileWriter with a write
callback, torch 2.x) hands each tensor's storage to `write` as one memoryview over the
tensor's own memory, never seeks, and calls nothing but `write` and `flush` (verified for
torch 2.13 by tests/unit/test_hashing_writer.py). A write whose memory lies inside `stable`
(the snapshot's host buffers, which nothing changes until the writer thread has finished the
save) is hashed in the background while later writes, the flush and the fsync go on; any other
write of 1 MiB or more is hashed before `write` returns (the caller may reuse its memory), and
smaller ones (record headers, pickles) are copied and hashed in batches. Anything else asked of
the file (a seek, or any method other than write, flush, tell) makes the bytes on disk unknown
to the hashes: `digest()` then answers None and the caller hashes the file by reading it back.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from .manifest import CHUNK_BYTES, CHUNK_HASHERS

SMALL_WRITE = 1 << 20  # writes below this are copied into a batch, hashed a batch at a time
COPY_BUDGET = 64 << 20  # copied bytes queued for hashing before `write` waits for them


@dataclass(frozen=True)
class WrittenDigest:
    """The hashes of exactly the bytes written into one file, in the manifest's format."""

    size: int
    sha256: str
    chunk_bytes: int
    chunk_sha256: tuple[str, ...]


@dataclass(frozen=True)
class WrittenFile:
    """One file as the writer thread left it: fsynced and renamed into place."""

    digest: WrittenDigest | None  # None: hash it by reading it back (see `HashingWriter`)
    write_s: float  # serialise + flush + fsync + rename, hashing alongside
    hash_wait_s: float  # of which waiting, after the fsync, for hashes still running


@dataclass(frozen=True)
class WrittenSave:
    """What one rank's writer knows of one save's files, handed to the uploader."""

    files: dict[str, WrittenFile] = field(default_factory=dict)  # by path as the writer named it
    queued_at: float = 0.0  # time.monotonic() when the host copy ended and the writes were queued
    write_s: float = 0.0  # the writer thread's time on these files

    @property
    def hash_wait_s(self) -> float:
        return sum(f.hash_wait_s for f in self.files.values())


class HashingWriter:
    """A write-only file object for `torch.save` that hashes what it writes into `fh`.

    `stable`: (address, bytes) of memory that stays unchanged until `digest()` or `close()`
    returns; writes inside it are hashed without `write` waiting. Use as a context manager (or
    call `close()`): the hashing threads stop, and no view of the caller's memory is kept."""

    def __init__(self, fh: BinaryIO, stable: Sequence[tuple[int, int]] = (),
                 chunk_bytes: int = CHUNK_BYTES, hashers: int = CHUNK_HASHERS) -> None:
        self._fh = fh
        spans = sorted((a, a + n) for a, n in stable if n > 0)
        self._starts = [a for a, _ in spans]
        self._ends = [e for _, e in spans]
        self._chunk = chunk_bytes
        self._whole = hashlib.sha256()
        self._whole_pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-write-sha256")
        self._piece_pool = ThreadPoolExecutor(hashers, thread_name_prefix="ckpt-write-pieces")
        self._whole_tail: Future[None] | None = None  # the last update queued (they run in order)
        self._pieces: list[Future[str]] = []
        self._open: list[memoryview | bytes] = []  # the piece being filled, as segments
        self._open_fill = 0
        self._batch = bytearray()  # small writes not yet queued
        self._copied = 0  # copied bytes queued since the hashers last caught up
        self._size = 0
        self.unknown: str | None = None  # why the hashes may not match the file, if they may not

    # -- the file object torch.save sees ---------------------------------------------------------

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n = view.nbytes
        if n == 0:
            return 0
        if n < SMALL_WRITE:
            _write_all(self._fh, view)
            self._batch += view
            self._size += n
            if len(self._batch) >= SMALL_WRITE:
                self._queue_batch()
            return n
        self._queue_batch()
        stable = self._is_stable(view)
        queued = self._queue(view, copy_open=not stable)
        try:
            _write_all(self._fh, view)
        finally:
            if not stable:  # the caller may reuse or free this memory once we return
                for f in queued:
                    f.result()
        self._size += n
        return n

    def flush(self) -> None:
        self._fh.flush()

    def tell(self) -> int:
        return self._size

    def writable(self) -> bool:
        return True

    def seek(self, *args: Any) -> int:
        self.unknown = "torch.save seeked in the file"
        return self._fh.seek(*args)

    def __getattr__(self, name: str) -> Any:
        # torch 2.13 asks for nothing else; a later one might rewrite bytes already hashed
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self._fh, name)
        self.unknown = f"torch.save used the file's {name!r}"
        return attr

    # -- results ---------------------------------------------------------------------------------

    def digest(self) -> WrittenDigest | None:
        """Waits for the hashes of everything written: None if the file may hold other bytes
        than the ones hashed (`unknown` says why)."""
        self._queue_batch()
        if self._open:
            self._pieces.append(self._piece_pool.submit(_hash_segments, self._open))
            self._open, self._open_fill = [], 0
        if self._whole_tail is not None:
            self._whole_tail.result()
        pieces = tuple(f.result() for f in self._pieces)
        if self.unknown is not None:
            return None
        return WrittenDigest(self._size, self._whole.hexdigest(), self._chunk, pieces)

    def close(self) -> None:
        """Stops the hashing threads (what they still have queued is dropped)."""
        self._whole_pool.shutdown(wait=True, cancel_futures=True)
        self._piece_pool.shutdown(wait=True, cancel_futures=True)
        self._open, self._batch = [], bytearray()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------

    def _is_stable(self, view: memoryview) -> bool:
        if not self._starts:
            return False
        import numpy as np  # here: the daemon imports upload.py, which imports this module

        address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        i = bisect.bisect_right(self._starts, address) - 1
        return i >= 0 and address + view.nbytes <= self._ends[i]

    def _queue_batch(self) -> None:
        if not self._batch:
            return
        batch, self._batch = self._batch, bytearray()
        self._copied += len(batch)
        self._queue(memoryview(batch), copy_open=False)
        if self._copied > COPY_BUDGET:  # bound the copies waiting for the hashers
            self._catch_up()

    def _catch_up(self) -> None:
        if self._whole_tail is not None:
            self._whole_tail.result()
        for f in self._pieces:
            f.result()
        self._copied = 0

    def _queue(self, view: memoryview, copy_open: bool) -> list[Future[Any]]:
        """Queues `view`'s bytes (the next ones of the file) for hashing; returns the tasks that
        read it. With `copy_open`, the part left in the unfinished piece is copied, so no task
        to come reads `view`."""
        whole = self._whole_pool.submit(self._whole.update, view)
        self._whole_tail = whole
        queued: list[Future[Any]] = [whole]
        pos, n = 0, view.nbytes
        while pos < n:
            take = min(self._chunk - self._open_fill, n - pos)
            self._open.append(view[pos:pos + take])
            self._open_fill += take
            pos += take
            if self._open_fill == self._chunk:
                piece = self._piece_pool.submit(_hash_segments, self._open)
                self._pieces.append(piece)
                queued.append(piece)
                self._open, self._open_fill = [], 0
        if copy_open and self._open:
            self._open[-1] = bytes(self._open[-1])
        return queued


def _hash_segments(segments: list[memoryview | bytes]) -> str:
    h = hashlib.sha256()
    for s in segments:
        h.update(s)
    return h.hexdigest()


def _write_all(fh: BinaryIO, view: memoryview) -> None:
    done = 0
    while done < view.nbytes:
        n = fh.write(view[done:])
        if not n:
            raise OSError(f"write to {getattr(fh, 'name', 'a checkpoint file')} returned {n!r}")
        done += n
