"""Small file helpers shared by the trainer and the daemon."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """tmp + fsync + rename: a reader sees the old file or the new one, never half of one (the
    temp name carries the pid and thread, so two writers never share one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
