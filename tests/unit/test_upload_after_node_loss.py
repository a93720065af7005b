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


def test_a_resumed_commit_whose_part_a_rank_never_wrote_is_not_waited_for(tmp_path):
    """A crash just after a snapshot: the crashed rank's process ended before writing its
    files of the step, so the new group's rank of that number has no marker of it and says so
    at start (CheckpointManager._tell_parts_gone). The resumed commit lists the store once
    more and is abandoned then, not after RESUMED_COMMIT_TIMEOUT_S (60 s, which held up every
    later commit and the job's end); the next checkpoint commits at once."""
    store, local = FileStorage(tmp_path / "store"), tmp_path / "local"
    files = _pending_on_rank0(local, 6, world=2)  # rank 1 wrote nothing of step 6
    marked = [[6], []]  # what the two ranks of the same world report at start
    up = Uploader(store, local, rank=0, world_size=2, commit_timeout=600)
    up.parts_gone(marked, 2)  # (nothing queued yet: no effect)
    assert up.resume_pending() == [6]
    assert up.parts_gone(marked, 2) == {6: [1]}
    newer = write_fake_checkpoint(local, 8, world_size=2)
    upload_rank_files(store, 8, 1, local, newer[1])
    up.submit(8, newer[0], meta_for(8, world_size=2))
    assert up.wait(15), "the newer checkpoint waited behind the resumed one"
    up.close()
    states = {c.step: c.state for c in Catalog(store, None).list()}
    assert states[8] is CkptState.COMMITTED and states.get(6) is not CkptState.COMMITTED
    marker = read_marker(layout.local_rank_marker(local, 6, 0))
    assert marker["state"] == "failed" and "abandoned" in marker["error"]
    assert "rank(s) [1] of the same world have no files of it" in marker["error"], marker
    assert files[1]  # rank 1's files existed in the fake save; only its marker is absent


def test_parts_gone_leaves_commits_of_another_world_and_complete_ones_alone(
        tmp_path, short_resume_wait):
    """Only a save of this same world is judged by its ranks' markers (after a node loss the
    saving world's ranks are not all here); a save whose parts are all in the store commits
    although a rank said it had no marker of it (the store is listed once more)."""
    store, local = FileStorage(tmp_path / "store"), tmp_path / "local"
    _pending_on_rank0(local, 10, world=3)  # saved by three, resumed by two
    up = Uploader(store, local, rank=0, world_size=2, commit_timeout=600)
    assert up.resume_pending() == [10]
    assert up.parts_gone([[10], []], 2) == {}  # another world: its bounded wait, as before
    up.close()

    store, local = FileStorage(tmp_path / "store2"), tmp_path / "local2"
    files = _pending_on_rank0(local, 12, world=2)
    upload_rank_files(store, 12, 1, local, files[1])  # its part is there, its marker is not
    up = Uploader(store, local, rank=0, world_size=2, commit_timeout=600)
    assert up.resume_pending() == [12]
    up.parts_gone([[12], []], 2)
    assert up.wait(15)
    up.close()
    assert {c.step: c.state for c in Catalog(store, None).list()} == {12: CkptState.COMMITTED}
