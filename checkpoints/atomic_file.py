"""Replacing a small file atomically: the new contents go to a temporary sibling, then a rename.

A reader sees the old file or the new one, never half of one. The temporary name carries the
process and the thread: two writers of one file (rank 0's upload thread committing while its
main thread rolls back, the ranks of a node restoring into one folder) each write their own, so
neither rename finds the other's gone (CI of 12-06: one temporary name per process, and a
rollback's worker died on that FileNotFoundError). A write that fails leaves no temporary file.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def replace_file(path: Path, data: bytes | str, *, fsync: bool = False) -> None:
    """Writes `data` (str as UTF-8) to `path` through a temporary sibling of this process and
    thread; `fsync` flushes it to the disk before the rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
