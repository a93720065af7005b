"""One conformance suite for every `Storage` backend: FileStorage and S3Storage on a real
moto_server (and Ceph RGW when its packages are installed; see tests/fixtures/rgw.py)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from ds3d.checkpoints.file_storage import FileStorage
from ds3d.checkpoints.s3_storage import S3Storage
from ds3d.checkpoints.storage import ObjectInfo, Storage, open_storage
from ds3d.trainer.errors import NotFoundError

pytest_plugins = ["fixtures.s3", "fixtures.rgw"]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["file", "moto", pytest.param("rgw", marks=pytest.mark.rgw)])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "file":
        return FileStorage(tmp_path / "store")
    if request.param == "moto":
        return request.getfixturevalue("make_s3_storage")("job/a")
    return request.getfixturevalue("make_rgw_storage")("job/a")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_is_a_storage(storage: Storage) -> None:
    assert isinstance(storage, Storage)
    storage.check_access()


def test_bytes_roundtrip_and_overwrite(storage: Storage) -> None:
    assert storage.put_bytes("a/b/c.json", b"one") is True
    assert storage.get_bytes("a/b/c.json") == b"one"
    storage.put_bytes("a/b/c.json", b"two")
    assert storage.get_bytes("a/b/c.json") == b"two"
    assert storage.exists("a/b/c.json")
    assert not storage.exists("a/b/nope")


def test_missing_key_is_not_found(storage: Storage, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        storage.get_bytes("no/such/key")
    with pytest.raises(NotFoundError):
        storage.get_file("no/such/key", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_small_file_roundtrip(storage: Storage, tmp_path: Path) -> None:
    src = tmp_path / "small.bin"
    src.write_bytes(os.urandom(1000))
    storage.put_file(src, "files/global_step1/small.bin")
    dst = tmp_path / "dl" / "deep" / "small.bin"
    storage.get_file("files/global_step1/small.bin", dst)
    assert dst.read_bytes() == src.read_bytes()
    assert [p.name for p in dst.parent.iterdir()] == ["small.bin"]  # no temp files left


def test_multipart_file_roundtrip(storage: Storage, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(12 << 20))  # > the 5 MiB threshold: 3 parts
    storage.put_file(src, "files/big.bin")
    assert storage.list("files/") == [ObjectInfo("files/big.bin", 12 << 20)]
    dst = tmp_path / "big.out"
    storage.get_file("files/big.bin", dst)
    assert _sha(dst) == _sha(src)


def test_multipart_really_used_on_s3(storage: Storage, tmp_path: Path) -> None:
    if not isinstance(storage, S3Storage):
        pytest.skip("S3 only")
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(11 << 20))
    storage.put_file(src, "mp.bin")
    head = storage.client.head_object(Bucket=storage.bucket, Key=storage.prefix + "mp.bin")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart ETag names its part count


def test_list_prefix_sorted_with_sizes(storage: Storage) -> None:
    for key, n in [("ckpt/step-00000002/x", 2), ("ckpt/step-00000001/b", 1),
                   ("ckpt/step-00000001/a/c", 3), ("ckptx/other", 4), ("latest", 5)]:
        storage.put_bytes(key, b"z" * n)
    assert storage.list("ckpt/step-00000001/") == [
        ObjectInfo("ckpt/step-00000001/a/c", 3), ObjectInfo("ckpt/step-00000001/b", 1)]
    assert [o.key for o in storage.list("ckpt/")] == [
        "ckpt/step-00000001/a/c", "ckpt/step-00000001/b", "ckpt/step-00000002/x"]
    assert [o.key for o in storage.list("ckpt")][-1] == "ckptx/other"
    assert len(storage.list()) == 5
    assert storage.list("nothing/") == []


def test_delete_is_idempotent(storage: Storage) -> None:
    storage.put_bytes("d/1", b"1")
    storage.put_bytes("d/2", b"2")
    storage.delete(["d/1", "d/missing"])
    assert [o.key for o in storage.list("d/")] == ["d/2"]
    storage.delete(["d/2"])
    storage.delete([])
    assert storage.list("d/") == []


def test_conditional_put(storage: Storage) -> None:
    assert storage.put_bytes("m/MANIFEST.json", b"first", if_absent=True) is True
    assert storage.put_bytes("m/MANIFEST.json", b"second", if_absent=True) is False
    assert storage.get_bytes("m/MANIFEST.json") == b"first"


def test_conditional_put_race_has_one_winner(storage: Storage) -> None:
    results: list[bool] = []
    lock = threading.Lock()

    def attempt(i: int) -> None:
        ok = storage.put_bytes("race/MANIFEST.json", f"writer-{i}".encode(), if_absent=True)
        with lock:
            results.append(ok)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 5 + [True]
    assert storage.get_bytes("race/MANIFEST.json").startswith(b"writer-")


def test_prefixes_isolate_jobs(storage: Storage, tmp_path: Path) -> None:
    storage.put_bytes("k", b"mine")
    other = open_storage(storage.url.rsplit("/", 1)[0] + "/b",
                         **_same_endpoint(storage))
    assert not other.exists("k")
    other.put_bytes("k", b"theirs")
    assert storage.get_bytes("k") == b"mine"


def _same_endpoint(storage: Storage) -> dict[str, object]:
    if isinstance(storage, S3Storage):
        creds = storage.client._request_signer._credentials  # test-only: reuse the same keys
        return {"endpoint_url": storage.endpoint_url, "access_key": creds.access_key,
                "secret_key": creds.secret_key}
    return {}
