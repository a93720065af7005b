"""FileStorage specifics beyond the shared conformance suite: atomicity and key safety."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ds3d.checkpoints.file_storage import FileStorage
from ds3d.trainer.errors import PermissionError_, StorageError

pytestmark = pytest.mark.timeout(30)


def test_keys_cannot_escape_the_root(tmp_path: Path) -> None:
    s = FileStorage(tmp_path / "store")
    for bad in ("../x", "a/../../x", "/abs", "a//b", "", "a/.tmp-ds3d-123"):
        with pytest.raises(StorageError):
            s.put_bytes(bad, b"x")
    with pytest.raises(StorageError, match="absolute"):
        FileStorage(Path("relative"))


def test_temp_files_are_invisible_and_cleaned(tmp_path: Path) -> None:
    s = FileStorage(tmp_path)
    s.put_bytes("a/b", b"1")
    (tmp_path / "a" / ".tmp-ds3d-leftover").write_bytes(b"crash")  # a killed writer's temp
    assert [o.key for o in s.list()] == ["a/b"]
    s.put_bytes("a/c", b"2", if_absent=True)
    s.put_bytes("a/c", b"3", if_absent=True)
    assert sorted(os.listdir(tmp_path / "a")) == [".tmp-ds3d-leftover", "b", "c"]


def test_readers_never_see_partial_objects(tmp_path: Path) -> None:
    s = FileStorage(tmp_path)
    big_a, big_b = b"a" * (4 << 20), b"b" * (4 << 20)
    s.put_bytes("obj", big_a)
    stop = threading.Event()
    seen: set[bytes] = set()

    def reader() -> None:
        while not stop.is_set():
            data = s.get_bytes("obj")
            seen.add(data[:1] + data[-1:] + str(len(data)).encode())

    t = threading.Thread(target=reader)
    t.start()
    for i in range(20):
        s.put_bytes("obj", big_b if i % 2 else big_a)
    stop.set()
    t.join()
    assert seen <= {b"aa" + str(4 << 20).encode(), b"bb" + str(4 << 20).encode()}


def test_delete_prunes_empty_folders(tmp_path: Path) -> None:
    s = FileStorage(tmp_path / "root")
    s.put_bytes("ckpt/step-00000001/files/x/y", b"1")
    s.delete(["ckpt/step-00000001/files/x/y"])
    assert list((tmp_path / "root").iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_read_only_store_is_a_permission_error(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(PermissionError_, match="write access"):
            FileStorage(root).check_access()
    finally:
        root.chmod(0o700)
