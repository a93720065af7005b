"""The `file://` store shares bytes with the local tier instead of copying them (issue 19,
goal 4): a hard link on the same file system, a copy across file systems."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pytest

from ds3d.checkpoints.file_storage import FileStorage


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_file_system_is_a_hard_link_that_outlives_the_local_copy(tmp_path: Path) -> None:
    local = tmp_path / "ckpt" / "global_step5" / "shard.pt"
    local.parent.mkdir(parents=True)
    local.write_bytes(os.urandom(1 << 20))
    digest = _sha(local)
    store = FileStorage(tmp_path / "store")
    store.put_file(local, "ckpt/step-5/files/shard.pt")
    stored = tmp_path / "store" / "ckpt" / "step-5" / "files" / "shard.pt"
    assert store.last_put == "link"
    assert stored.stat().st_ino == local.stat().st_ino
    assert local.stat().st_nlink == 2
    assert _sha(stored) == digest
    # a new save replaces the local file by rename (a new inode): the stored object keeps
    # the old bytes; retention deleting the local copy leaves the store's intact
    replacement = local.with_name("shard.pt.tmp")
    replacement.write_bytes(b"newer save")
    os.replace(replacement, local)
    assert _sha(stored) == digest
    local.unlink()
    assert _sha(stored) == digest and stored.stat().st_nlink == 1
    assert store.get_bytes("ckpt/step-5/files/shard.pt") == stored.read_bytes()


def test_another_file_system_gets_a_copy(tmp_path: Path) -> None:
    other = Path("/dev/shm")
    if not other.is_dir() or other.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another file system than the test's temporary folder")
    local = tmp_path / "shard.pt"
    local.write_bytes(os.urandom(300_000))
    with tempfile.TemporaryDirectory(dir=other) as root:
        store = FileStorage(root)
        store.put_file(local, "a/shard.pt")
        stored = Path(root) / "a" / "shard.pt"
        assert store.last_put in ("copy", "reflink")
        assert stored.stat().st_ino != local.stat().st_ino or \
            stored.stat().st_dev != local.stat().st_dev
        assert _sha(stored) == _sha(local)
        assert local.stat().st_nlink == 1
