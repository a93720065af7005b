"""host_memory.populate: pages faulted in before registration, bytes kept."""

from __future__ import annotations

import ctypes
import mmap
import os

from ds3d.checkpoints.host_memory import anonymous_buffer, populate


def _resident_pages(buf: mmap.mmap) -> int:
    """Pages of `buf` mapped into this process now (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    n = (len(buf) + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(address, len(buf), vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec)


def test_populate_faults_in_every_page_of_a_fresh_buffer():
    buf = anonymous_buffer(64 << 20)
    before = _resident_pages(buf)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert populate(address, len(buf), threads=3, piece=5 << 20)  # pieces not dividing it
    assert before < len(buf) // mmap.PAGESIZE
    assert _resident_pages(buf) == len(buf) // mmap.PAGESIZE


def test_populate_keeps_the_bytes_of_a_shared_file_mapping(tmp_path):
    # node memory's arena: a file mapped shared, which may hold a crashed worker's snapshot
    path = tmp_path / "arena"
    data = os.urandom(3 << 20) + b"tail"
    path.write_bytes(data)
    with open(path, "r+b") as fh:
        buf = mmap.mmap(fh.fileno(), len(data), mmap.MAP_SHARED)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert populate(address + 4096, len(data) - 4096, piece=1 << 20)  # an offset start too
    assert bytes(buf) == data
    assert _resident_pages(buf) == (len(data) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
