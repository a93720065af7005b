"""The first commit, local-complete (checkpoints/local_complete.py): each rank's files hashed once
right after the save and recorded on local disk, before and whatever the upload does; which step
a group agrees to restore from; and a restore to an older step dropping the newer, uncommitted
ones (their uploads stop, their local files go)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ds3d.checkpoints import layout
from ds3d.checkpoints.identity import new_job_id
from ds3d.checkpoints.local_complete import (
    agree_local_step,
    complete_here,
    own_files_verify,
    read_record,
    write_record,
)
from ds3d.checkpoints.manifest import file_entries
from ds3d.checkpoints.storage import open_storage
from ds3d.checkpoints.upload import Uploader, UploadEvent, read_marker

from fixtures.ckpt import meta_for, write_fake_checkpoint

JOB_ID = new_job_id()


def save_local(local: Path, step: int, world: int, ranks: list[int] | None = None) -> None:
    """A save of `world` ranks on this disk; records for `ranks` (default: all)."""
    files = write_fake_checkpoint(local, step, world)
    meta = meta_for(step, world).model_copy(update={"job_id": JOB_ID})
    for rank in ranks if ranks is not None else range(world):
        write_record(local, step, rank, file_entries(local, files[rank]), meta)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def test_uploader_records_local_complete_before_uploading(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}/store")
    local = tmp_path / "local"
    events: list[UploadEvent] = []
    up = Uploader(storage, local, 0, 1, on_event=events.append)
    try:
        files = write_fake_checkpoint(local, 5)[0]
        up.submit(5, files, meta_for(5).model_copy(update={"job_id": JOB_ID}))
        assert up.wait(30)
    finally:
        up.close(10)
    assert [e.kind for e in events] == ["local_complete", "uploaded", "committed"]
    rec = read_record(local, 5, 0)
    assert rec is not None and rec.meta.job_id == JOB_ID
    assert rec.part.files == file_entries(local, files)  # sizes and sha256 of what was written
    # the part in the store carries the same hashes: the files were hashed once
    stored = storage.get_bytes(layout.part_key(5, 0)).decode()
    assert all(e.sha256 in stored for e in rec.part.files)


def test_complete_here_needs_every_ranks_files_on_this_disk(tmp_path: Path) -> None:
    node_a, node_b = tmp_path / "a", tmp_path / "b"
    save_local(node_a, 10, 2)
    manifest = complete_here(node_a, 10, 2, JOB_ID)
    assert manifest is not None and manifest.step == 10
    assert len(manifest.files) == len(write_fake_checkpoint(tmp_path / "x", 10, 2)[0]) + 2
    # another node holds only its own rank's record and files: not restorable there alone
    save_local(node_b, 10, 2, ranks=[1])
    assert complete_here(node_b, 10, 2, JOB_ID) is None
    # another job's records, or a group of another size, are not this one's
    assert complete_here(node_a, 10, 2, new_job_id()) is None
    assert complete_here(node_a, 10, 4, JOB_ID) is None
    # a file gone (a wiped disk): not complete
    (node_a / "global_step10" / "layer_01-model_00-model_states.pt").unlink()
    assert complete_here(node_a, 10, 2, JOB_ID) is None


def test_own_files_verify_catches_changed_bytes_of_the_same_size(tmp_path: Path) -> None:
    save_local(tmp_path, 10, 2)
    assert own_files_verify(tmp_path, 10, 0) and own_files_verify(tmp_path, 10, 1)
    flip_byte(tmp_path / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert complete_here(tmp_path, 10, 2, JOB_ID) is not None  # sizes still match
    assert own_files_verify(tmp_path, 10, 0) and not own_files_verify(tmp_path, 10, 1)


def test_agree_local_step_takes_the_newest_that_verifies(tmp_path: Path, one_rank_group) -> None:
    cpu = torch.device("cpu")
    assert agree_local_step(tmp_path, 0, 1, JOB_ID, cpu) == (-1, None)
    for step in (5, 10, 15):
        save_local(tmp_path, step, 1)
    step, manifest = agree_local_step(tmp_path, 0, 1, JOB_ID, cpu)
    assert step == 15 and manifest is not None and manifest.step == 15
    flip_byte(tmp_path / "global_step15" / "mp_rank_00_model_states.pt")
    assert agree_local_step(tmp_path, 0, 1, JOB_ID, cpu)[0] == 10
    (tmp_path / "global_step10" / "mp_rank_00_model_states.pt").unlink()
    assert agree_local_step(tmp_path, 0, 1, JOB_ID, cpu)[0] == 5


def test_drop_newer_than_stops_uploads_and_deletes_local_copies(tmp_path: Path) -> None:
    """Rank 0 of a two-rank save whose rank 1 never uploads: step 5's commit waits for the
    missing part, step 10 is queued behind it. A restore to step 5 drops 10; a restore to
    nothing (a fresh start) drops 5 too, and its waiting commit ends at once."""
    storage = open_storage(f"file://{tmp_path}/store")
    local = tmp_path / "local"
    events: list[UploadEvent] = []
    up = Uploader(storage, local, 0, 2, commit_timeout=120, on_event=events.append)
    try:
        for step in (5, 10):
            files = write_fake_checkpoint(local, step, 2)[0]
            up.submit(step, files, meta_for(step, 2).model_copy(update={"job_id": JOB_ID}))
        deadline = time.monotonic() + 30
        while not storage.exists(layout.part_key(5, 0)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert storage.exists(layout.part_key(5, 0))  # step 5's commit now waits for rank 1
        assert up.drop_newer_than(5) == [10]
        assert up.pending() == [5]
        assert not (local / "global_step10" / "mp_rank_00_model_states.pt").exists()
        assert read_record(local, 10, 0) is None
        assert read_marker(layout.local_rank_marker(local, 10, 0)) is None
        assert up.drop_newer_than(-1) == [5]
        t0 = time.monotonic()
        assert up.wait(30)
        assert time.monotonic() - t0 < 10  # not the 120 s commit timeout
    finally:
        up.close(10)
    assert up.pending() == [] and up.failed() == []
    assert not storage.exists(layout.manifest_key(5)) and not storage.exists(
        layout.manifest_key(10))
    assert read_marker(layout.local_rank_marker(local, 5, 0)) is None  # not re-created
    assert "abandoned" in [e.kind for e in events if e.step == 5]
    assert not storage.exists(layout.part_key(10, 0))  # never uploaded


def test_a_drop_while_a_marker_is_written_leaves_no_marker(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore's drop that comes between the upload thread's "still wanted?" check and its
    marker write waits for that write and then deletes it: the dropped step leaves no marker
    (once seen in CI: an `uploaded` marker re-created after the drop)."""
    import threading

    from ds3d.checkpoints import upload

    storage = open_storage(f"file://{tmp_path}/store")
    local = tmp_path / "local"
    real_write = upload.write_marker
    up = Uploader(storage, local, 0, 2, commit_timeout=120)
    dropper: list[threading.Thread] = []

    def write_marker_with_a_drop(*args, **kwargs):  # type: ignore[no-untyped-def]
        if args[3] == "uploaded" and not dropper:  # the drop arrives now, mid-write
            dropper.append(threading.Thread(target=up.drop_newer_than, args=(-1,)))
            dropper[0].start()
            time.sleep(0.5)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(upload, "write_marker", write_marker_with_a_drop)
    try:
        files = write_fake_checkpoint(local, 5, 2)[0]
        up.submit(5, files, meta_for(5, 2).model_copy(update={"job_id": JOB_ID}))
        deadline = time.monotonic() + 30
        while not dropper and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dropper, "the upload never reached its `uploaded` marker"
        dropper[0].join(30)
        assert up.wait(30)
    finally:
        up.close(10)
    assert read_marker(layout.local_rank_marker(local, 5, 0)) is None
    assert read_record(local, 5, 0) is None
