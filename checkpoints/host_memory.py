"""Large anonymous host buffers, backed by transparent huge pages where the kernel allows.

A restore reads a 19.8 GB state into fresh memory and the snapshot arena page-locks 22 GB:
with 4 KiB pages that is ~5 million page faults (each zeroing a page, serialised on the
process's memory-map lock when many reader threads fault at once) and as many pages for
`cudaHostRegister` to pin. `MADV_HUGEPAGE` asks for 2 MiB pages instead (512x fewer), when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`; elsewhere it changes
nothing and the buffer is an ordinary mapping.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor


def anonymous_buffer(nbytes: int) -> mmap.mmap:
    """A private, zero-filled mapping of `nbytes` (> 0), advised to use huge pages."""
    buf = mmap.mmap(-1, nbytes)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as before
            pass
    return buf


# madvise(2) advice that faults a range in writable without changing its bytes (Linux 5.14+);
# Python's mmap module does not name it before 3.13
MADV_POPULATE_WRITE = 23
POPULATE_PIECE_BYTES = 256 << 20
POPULATE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))


def populate(address: int, nbytes: int, threads: int = POPULATE_THREADS,
             piece: int = POPULATE_PIECE_BYTES) -> bool:
    """Faults [address, address + nbytes) in (allocating and zeroing fresh pages, mapping a
    file's pages into this process) before it is registered with CUDA, on `threads` threads
    that hold neither the GIL (ctypes lets it go) nor CUDA's driver lock. Registering fresh
    memory does that faulting itself, under the driver lock: 20 GiB took 6-7 s during which
    other threads' CUDA work ran at 7-11% of its pace; populated first, the registration took
    0.6 s (H100, `gpu_bench.py --sections pinning`). The bytes are kept (a held snapshot's
    arena is populated too). Returns False where the kernel lacks the advice (before 5.14):
    registration then faults the pages in as before."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    start = address - address % page

    def one(offset: int) -> int:
        n = min(piece, address + nbytes - offset)
        return 0 if madvise(offset, n, MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()

    offsets = range(start, address + nbytes, piece)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-populate") as pool:
        errors = [e for e in pool.map(one, offsets) if e]
    return not errors


# Page-locking 20 GB with one cudaHostRegister holds CUDA's driver lock for ~8-11 s on an
# H200: every kernel launch and copy of the training thread (or of a restore's engine build)
# waits behind it. Registered a piece at a time, the lock is let go between pieces.
PIN_PIECE_BYTES = 1 << 30


def register_in_pieces(address: int, nbytes: int, piece: int = PIN_PIECE_BYTES,
                       pause_s: float = 0.002) -> list[int] | None:
    """Page-locks [address, address + nbytes) with CUDA one `piece` at a time, pausing between
    pieces so that other threads' CUDA calls get the driver in between. Returns the registered
    pieces' addresses (for `unregister_pieces`), or None, with nothing left registered, when
    one failed (host memory short, or the locked-memory limit)."""
    import time

    import torch

    cudart = torch.cuda.cudart()
    done: list[int] = []
    for offset in range(0, nbytes, piece):
        if int(cudart.cudaHostRegister(address + offset, min(piece, nbytes - offset), 0)) != 0:
            unregister_pieces(done)
            return None
        done.append(address + offset)
        time.sleep(pause_s)
    return done


def unregister_pieces(addresses: list[int]) -> None:
    if not addresses:
        return
    import torch

    cudart = torch.cuda.cudart()
    for address in addresses:
        cudart.cudaHostUnregister(address)


def piece_ranges(offset: int, nbytes: int, element_size: int,
                 piece: int = PIN_PIECE_BYTES) -> list[tuple[int, int]]:
    """The element ranges of a tensor at byte `offset` of a buffer registered in `piece`s that
    each lie within one piece (a copy across two registrations may run as pageable memory).
    `offset` is a multiple of the element size, as every carved tensor's is."""
    ranges, a, end = [], offset, offset + nbytes
    while a < end:
        b = min(end, (a // piece + 1) * piece)
        ranges.append(((a - offset) // element_size, (b - offset) // element_size))
        a = b
    return ranges
