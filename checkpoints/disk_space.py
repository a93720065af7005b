"""Telling a full disk from other write errors, and saying how much space was missing.

A full file system surfaces in many shapes: `OSError(ENOSPC)` (or `EDQUOT` past a quota) from a
plain write, a `RuntimeError` from `torch.save` whose context is that OSError, SQLite's
"database or disk is full". Every writer that must survive a full disk (the checkpoint writer,
the file store, the reports, the daemon's own store) asks `is_disk_full` and describes the
problem with `shortage`, so every message names the same three facts: the path, the bytes
free on its file system and the bytes the write needed.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException | None) -> bool:
    """True when `exc`, or an exception it was raised from or while handling, says the file
    system (or the user's quota) is full."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        text = str(exc).lower()
        if "database or disk is full" in text or "no space left on device" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def existing_ancestor(path: str | Path) -> Path:
    """`path` itself or its nearest ancestor that exists (statvfs needs an existing path)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path`."""
    st = os.statvfs(existing_ancestor(path))
    return st.f_bavail * st.f_frsize


def mount_point(path: str | Path) -> Path:
    """The mount point of the file system holding `path` (for messages: which disk)."""
    p = existing_ancestor(path)
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def human(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


@dataclass(frozen=True)
class Shortage:
    """A write that did not fit: where, how much it needed, how much was free."""

    path: str
    needed: int  # bytes the write needed (an estimate where the writer cannot know exactly)
    free: int    # bytes free on that file system when measured
    mount: str

    def message(self, what: str) -> str:
        return (f"no space left on the disk for {what}: {self.path} (file system at "
                f"{self.mount}) has {human(self.free)} free ({self.free} bytes), "
                f"{human(self.needed)} ({self.needed} bytes) needed; free space there or "
                "point it at a larger disk")

    def fields(self) -> dict[str, object]:
        return {"path": self.path, "bytes_needed": self.needed, "bytes_free": self.free,
                "mount": self.mount}


def shortage(path: str | Path, needed: int) -> Shortage:
    """Measures the free space now on `path`'s file system."""
    try:
        free, mount = free_bytes(path), str(mount_point(path))
    except OSError:
        free, mount = 0, "?"
    return Shortage(str(path), max(0, int(needed)), free, mount)
