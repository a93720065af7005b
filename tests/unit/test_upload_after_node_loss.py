"""Uploads left pending when a node was lost: the committer of the next, smaller world commits
them against the world that saved them, and abandons one whose missing part's owner is gone
(after a bounded wait) instead of holding up every newer checkpoint behind it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds3d.checkpoints import layout, upload
from ds3d.checkpoints.catalog import Catalog, CkptState
from ds3d.checkpoints.file_storage import FileStorage
from ds3d.checkpoints.upload import Uploader, read_marker, upload_rank_files, write_marker

from fixtures.ckpt import meta_for, write_fake_checkpoint


@pytest.fixture
def short_resume_wait(monkeypatch):
    monkeypatch.setattr(upload, "RESUMED_COMMIT_TIMEOUT_S", 1.0)


def _pending_on_rank0(local: Path, step: int, world: int) -> dict[int, list[str]]:
    """Every rank saved `step` of a `world`-rank job; rank 0's process died before uploading."""
    files = write_fake_checkpoint(local, step, world_size=world)
    write_marker(local, step, 0, "pending", files[0], meta_for(step, world_size=world))
    return files


def test_resumed_commit_counts_the_parts_of_the_world_that_saved_it(tmp_path, short_resume_wait):
    store, local = FileStorage(tmp_path / "store"), tmp_path / "local"
    files = _pending_on_rank0(local, 10, world=3)
    for rank in (1, 2):  # the other ranks' parts were uploaded before the loss
        upload_rank_files(store, 10, rank, local, files[rank])
    up = Uploader(store, local, rank=0, world_size=2)  # the job now runs on two
    assert up.resume_pending() == [10]
    assert up.wait(30)
    up.close()
    [ckpt] = Catalog(store, None).list()
    assert ckpt.step == 10 and ckpt.state is CkptState.COMMITTED
    manifest = Catalog(store, None).load_manifest(10)
    assert manifest.layout.world_size == 3
    # all three ranks' files, not the first two of the world that resumed it
    assert {e.path for e in manifest.files} == {f for fs in files.values() for f in fs}


def test_resumed_commit_missing_a_lost_ranks_part_is_abandoned_not_blocking(
        tmp_path, short_resume_wait):
    store, local = FileStorage(tmp_path / "store"), tmp_path / "local"
    files = _pending_on_rank0(local, 10, world=3)
    upload_rank_files(store, 10, 1, local, files[1])  # rank 2's node died before its upload
    up = Uploader(store, local, rank=0, world_size=2, commit_timeout=600)
    assert up.resume_pending() == [10]
    newer = write_fake_checkpoint(local, 12, world_size=2)
    upload_rank_files(store, 12, 1, local, newer[1])
    up.submit(12, newer[0], meta_for(12, world_size=2))
    assert up.wait(30), "the newer checkpoint waited behind the abandoned one"
    up.close()
    assert up.pending() == [] and up.failed() == []
    states = {c.step: c.state for c in Catalog(store, None).list()}
    assert states[12] is CkptState.COMMITTED and states.get(10) is not CkptState.COMMITTED
    marker = read_marker(layout.local_rank_marker(local, 10, 0))
    assert marker["state"] == "failed" and "abandoned" in marker["error"]
    assert "missing ranks [2]" in marker["error"]
