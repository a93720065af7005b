"""Small file helpers shared by the trainer and the daemon."""

from __future__ import annotations

from pathlib import Path

from ds3d.checkpoints.atomic_file import replace_file


def atomic_write_text(path: Path, text: str) -> None:
    """Replaces `path` atomically and durably (checkpoints/atomic_file.py, fsync'd), making its
    folder first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, text, fsync=True)
