"""The commit protocol and the background Uploader against FileStorage and a real moto_server:
parts then MANIFEST last, commit timeouts, stores that ignore conditional puts, queued saves,
failed uploads retried, and restore from the store into an empty local tier."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import structlog

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog, CkptState
from ds3d.checkpoints.file_storage import FileStorage
from ds3d.checkpoints.manifest import Manifest
from ds3d.checkpoints.storage import Storage
from ds3d.checkpoints.upload import (
    Uploader,
    UploadEvent,
    commit_checkpoint,
    read_marker,
    upload_rank_files,
)
from ds3d.trainer.errors import CheckpointError, StateError, TransientStorageError

from fixtures.ckpt import meta_for, write_fake_checkpoint

pytest_plugins = ["fixtures.s3"]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["file", "moto"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "file":
        return FileStorage(tmp_path / "store")
    return request.getfixturevalue("make_s3_storage")("jobs/j1")


def test_ranks_upload_then_one_commit(store: Storage, tmp_path: Path) -> None:
    local = tmp_path / "local"
    files = write_fake_checkpoint(local, 100, world_size=3, size=3000,
                                  big={"global_step100/mp_rank_00_model_states.pt": 6 << 20})
    meta = meta_for(100, 3)
    result: list[Manifest] = []
    committer = threading.Thread(target=lambda: result.append(
        commit_checkpoint(store, 100, 3, meta, timeout=30, poll_interval=0.05)))
    committer.start()  # polls for parts while the ranks upload
    ranks = [threading.Thread(target=upload_rank_files, args=(store, 100, r, local, files[r]))
             for r in range(3)]
    for t in ranks:
        t.start()
    for t in ranks + [committer]:
        t.join()
    (manifest,) = result
    assert sorted(f.path for f in manifest.files) == sorted(sum(files.values(), []))
    assert Manifest.from_json(store.get_bytes(layout.manifest_key(100))) == manifest
    assert store.get_bytes(layout.LATEST_KEY) == b"ckpt/step-00000100"
    assert [o.key for o in store.list(layout.parts_prefix(100))] == [
        layout.part_key(100, r) for r in range(3)]

    catalog = Catalog(store, tmp_path / "fresh")  # a new node with an empty local tier
    (info,) = catalog.list()
    assert (info.step, info.state, info.size) == (100, CkptState.COMMITTED, manifest.total_size)
    assert catalog.verify(100, checksums=True) == []
    restored = catalog.newest_restorable()
    assert restored is not None and restored.source == "downloaded"
    for f in manifest.files:
        assert (tmp_path / "fresh" / f.path).read_bytes() == (local / f.path).read_bytes()
    again = catalog.newest_restorable()
    assert again is not None and again.source == "local"


def test_commit_times_out_without_all_parts(store: Storage, tmp_path: Path) -> None:
    files = write_fake_checkpoint(tmp_path, 3, world_size=3)
    upload_rank_files(store, 3, 0, tmp_path, files[0])
    upload_rank_files(store, 3, 2, tmp_path, files[2])
    with pytest.raises(CheckpointError, match=r"only 2 of 3 .*missing ranks \[1\]"):
        commit_checkpoint(store, 3, 3, meta_for(3, 3), timeout=0.3, poll_interval=0.05)
    assert not store.exists(layout.manifest_key(3))
    (info,) = Catalog(store, None).list()
    assert info.state is CkptState.UPLOADING
    assert Catalog(store, tmp_path / "other").newest_restorable() is None


class IgnoresConditions:
    """A store like JuiceFS's or rclone's S3 gateway: If-None-Match is silently ignored."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.url = inner, inner.url

    def put_bytes(self, key: str, data: bytes, if_absent: bool = False) -> bool:
        return self.inner.put_bytes(key, data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_commit_is_idempotent_and_verified_on_lying_stores(store: Storage, tmp_path: Path) -> None:
    files = write_fake_checkpoint(tmp_path, 9)
    upload_rank_files(store, 9, 0, tmp_path, files[0])
    first = commit_checkpoint(store, 9, 1, meta_for(9), timeout=5)
    again = commit_checkpoint(store, 9, 1, meta_for(9), timeout=5)  # e.g. a retry after a crash
    assert again.files == first.files

    # Another committer's different manifest is already there, and the store ignores the
    # condition: the read-back catches it instead of trusting the 200.
    liar = IgnoresConditions(store)
    store.put_bytes(layout.part_key(9, 0), store.get_bytes(layout.part_key(9, 0)).replace(
        first.files[0].sha256.encode(), b"0" * 64))
    with pytest.raises(CheckpointError, match="different MANIFEST"):
        commit_checkpoint(liar, 9, 1, meta_for(9), timeout=5)  # type: ignore[arg-type]
    assert Manifest.from_json(store.get_bytes(layout.manifest_key(9))).files == first.files


class LosesRace(IgnoresConditions):
    """Answers 200 to the conditional put, but another committer's manifest ends up stored."""

    def put_bytes(self, key: str, data: bytes, if_absent: bool = False) -> bool:
        if key.endswith("MANIFEST.json"):
            other = Manifest.from_json(data)
            data = other.model_copy(update={"files": other.files[1:]}).to_json()
        return self.inner.put_bytes(key, data)


def test_commit_reads_back_what_was_stored(store: Storage, tmp_path: Path) -> None:
    files = write_fake_checkpoint(tmp_path, 11)
    upload_rank_files(store, 11, 0, tmp_path, files[0])
    with pytest.raises(CheckpointError, match="different MANIFEST"):
        commit_checkpoint(LosesRace(store), 11, 1, meta_for(11), timeout=5)  # type: ignore[arg-type]
    assert not store.exists(layout.LATEST_KEY)


def test_committed_step_is_never_overwritten(store: Storage, tmp_path: Path) -> None:
    files = write_fake_checkpoint(tmp_path / "a", 4)
    upload_rank_files(store, 4, 0, tmp_path / "a", files[0])
    commit_checkpoint(store, 4, 1, meta_for(4), timeout=5)
    upload_rank_files(store, 4, 0, tmp_path / "a", files[0])  # same bytes: a harmless no-op
    write_fake_checkpoint(tmp_path / "b", 4)  # a re-save of step 4 with other bytes
    with pytest.raises(CheckpointError, match="already committed"):
        upload_rank_files(store, 4, 0, tmp_path / "b", files[0])
    assert Catalog(store, tmp_path / "a").verify(4, checksums=True) == []


class Recording:
    """Wraps a store: records file uploads, can slow them down or fail the first few."""

    def __init__(self, inner: Storage, delay: float = 0.0, fail_first: int = 0) -> None:
        self.inner, self.url, self.delay, self.fail_left = inner, inner.url, delay, fail_first
        self.puts: list[str] = []

    def put_file(self, local_path: str | Path, key: str) -> None:
        if self.fail_left > 0:
            self.fail_left -= 1
            raise TransientStorageError("injected outage")
        time.sleep(self.delay)
        self.puts.append(key)
        self.inner.put_file(local_path, key)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_uploader_queues_saves_in_order(store: Storage, tmp_path: Path) -> None:
    slow = Recording(store, delay=0.05)
    events: list[UploadEvent] = []
    up = Uploader(slow, tmp_path, rank=0, world_size=1, commit_timeout=5,  # type: ignore[arg-type]
                  on_event=events.append)
    t0 = time.monotonic()
    for step in (10, 20, 30):
        files = write_fake_checkpoint(tmp_path, step)
        up.submit(step, files[0], meta_for(step))
        up.submit(step, files[0], meta_for(step))  # a duplicate submit is ignored
    assert time.monotonic() - t0 < 1.0  # submit never waits for the upload
    assert up.pending() == [10, 20, 30]
    assert up.wait(timeout=60)
    up.close()
    steps_in_order = [layout.step_of_key(k) for k in slow.puts]
    assert steps_in_order == sorted(steps_in_order)  # one checkpoint at a time, oldest first
    durable = [(e.kind, e.step) for e in events if e.kind != "local_complete"]
    assert durable == [("uploaded", 10), ("committed", 10), ("uploaded", 20), ("committed", 20),
                       ("uploaded", 30), ("committed", 30)]
    # the first commit (the verify thread's, before any upload of its step) may run ahead
    local = [(i, e.step) for i, e in enumerate(events) if e.kind == "local_complete"]
    assert [step for _, step in local] == [10, 20, 30]
    for i, step in local:
        assert i < [(e.kind, e.step) for e in events].index(("uploaded", step))
    assert [c.step for c in Catalog(store, tmp_path).list()
            if c.state is CkptState.COMMITTED] == [10, 20, 30]
    assert read_marker(layout.local_rank_marker(tmp_path, 30, 0))["state"] == "committed"


def test_failed_upload_keeps_local_copy_and_is_retried(store: Storage, tmp_path: Path) -> None:
    flaky = Recording(store, fail_first=1)
    events: list[UploadEvent] = []
    up = Uploader(flaky, tmp_path, rank=0, world_size=1, retry_interval=0.2,  # type: ignore[arg-type]
                  on_event=events.append)
    files = write_fake_checkpoint(tmp_path, 50)
    with structlog.testing.capture_logs() as logs:
        up.submit(50, files[0], meta_for(50))
        assert up.wait(10)
    # local-complete (verified on disk) whatever the store does; then the upload failed
    assert [e.kind for e in events] == ["local_complete", "failed"], events
    assert "injected outage" in events[1].detail
    assert any(e["event"] == "checkpoint_upload_failed" for e in logs)
    assert read_marker(layout.local_rank_marker(tmp_path, 50, 0))["state"] == "failed"
    assert all((tmp_path / f).is_file() for f in files[0])
    assert up.failed() == [50] and up.pending() == [50]
    assert Catalog(store, tmp_path).list()[0].state is not CkptState.COMMITTED
    deadline = time.monotonic() + 20
    while up.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    up.close()
    assert [e.kind for e in events] == ["local_complete", "failed", "uploaded", "committed"]
    assert Catalog(store, tmp_path).list()[0].state is CkptState.COMMITTED


def test_unfinished_uploads_resume_after_restart(store: Storage, tmp_path: Path) -> None:
    files = write_fake_checkpoint(tmp_path, 60, world_size=2)
    for rank in (0, 1):  # both ranks' processes die right after queueing the save
        up = Uploader(Recording(store, fail_first=99), tmp_path, rank=rank,  # type: ignore[arg-type]
                      world_size=2, retry_interval=60)
        up.submit(60, files[rank], meta_for(60, 2))
        up.wait(10)
        up.close()
    with pytest.raises(StateError):  # the unfinished local copy is protected
        Catalog(store, tmp_path).delete(60)
    r1 = Uploader(store, tmp_path, rank=1, world_size=2)
    r0 = Uploader(store, tmp_path, rank=0, world_size=2, commit_timeout=30)
    assert r1.resume_pending() == [60] and r0.resume_pending() == [60]
    assert r0.wait(60) and r1.wait(60)
    r0.close()
    r1.close()
    assert Catalog(store, tmp_path).list()[0].state is CkptState.COMMITTED


def test_restore_from_local_manifest_during_outage(store: Storage, tmp_path: Path) -> None:
    files = write_fake_checkpoint(tmp_path, 70)
    up = Uploader(store, tmp_path, rank=0, world_size=1)
    up.submit(70, files[0], meta_for(70))
    up.wait(30)
    up.close()

    class Down:
        url = store.url

        def list(self, prefix: str = "") -> list[object]:
            raise TransientStorageError("endpoint down")

        def get_bytes(self, key: str) -> bytes:
            raise TransientStorageError("endpoint down")

    with structlog.testing.capture_logs() as logs:
        found = Catalog(Down(), tmp_path).newest_restorable()  # type: ignore[arg-type]
    assert found is not None and (found.step, found.source) == (70, "local")
    assert any(e["event"] == "checkpoint_store_unreachable" for e in logs)
