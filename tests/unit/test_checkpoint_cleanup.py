"""Cleanup on a real file store: leftovers of unfinished saves go once older than the grace
period, and a failed cleanup changes the state of no checkpoint (issue 24 items 5 and 6)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog, CkptState
from ds3d.checkpoints.identity import new_job_id
from ds3d.checkpoints.storage import Storage, open_storage
from ds3d.checkpoints.upload import (
    Uploader,
    UploadEvent,
    commit_checkpoint,
    read_marker,
    upload_rank_files,
    write_marker,
)

from fixtures.ckpt import meta_for, write_fake_checkpoint

JOB_ID = new_job_id()


def commit(storage: Storage, local: Path, step: int) -> None:
    files = write_fake_checkpoint(local, step)[0]
    upload_rank_files(storage, step, 0, local, files, job_id=JOB_ID)
    commit_checkpoint(storage, step, 1, meta_for(step).model_copy(update={"job_id": JOB_ID}),
                      timeout=5)


def age(root: Path, seconds: float) -> None:
    """Backdates every file under `root` (what an interrupted save left long ago)."""
    t = time.time() - seconds
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            os.utime(Path(dirpath) / name, (t, t))


def test_leftovers_older_than_the_grace_period_are_removed(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    storage = open_storage(f"file://{store_dir}")
    local = tmp_path / "local"
    commit(storage, local, 10)
    files = write_fake_checkpoint(local, 20)[0]  # uploaded, never committed (a crash)
    upload_rank_files(storage, 20, 0, local, files, job_id=JOB_ID)
    commit(storage, local, 30)
    temp = store_dir / "ckpt" / "step-00000030" / "files" / ".tmp-ds3d-0123abcd"  # kill -9
    temp.write_bytes(b"x" * 100)
    age(store_dir, 7200)
    files = write_fake_checkpoint(local, 40)[0]  # newer than the newest commit: may be uploading
    upload_rank_files(storage, 40, 0, local, files, job_id=JOB_ID)
    age(store_dir / "ckpt" / "step-00000040", 7200)
    young = store_dir / "ckpt" / "step-00000010" / ".tmp-ds3d-young"
    young.write_bytes(b"y")

    catalog = Catalog(storage, local, job_id=JOB_ID)
    assert catalog.sweep(grace_s=86400).steps == []  # nothing is that old
    result = catalog.sweep(grace_s=3600)
    assert result.steps == [20] and not result.failed
    assert result.temporaries == ["ckpt/step-00000030/files/.tmp-ds3d-0123abcd"]
    assert not temp.exists() and young.exists()
    states = {c.step: c.state for c in Catalog(storage, None).list()}  # the store only
    assert states == {10: CkptState.COMMITTED, 30: CkptState.COMMITTED,
                      40: CkptState.UPLOADING}
    assert catalog.verify(10) == [] and catalog.verify(30) == []


def test_a_failed_cleanup_changes_no_other_checkpoint(tmp_path: Path) -> None:
    """One step whose delete fails is reported on its own; the others are still deleted, and
    a committed step whose local marker (another rank's) says `failed` is deleted too: that
    refusal is what made a failed cleanup cascade over 41 committed steps."""
    storage = open_storage(f"file://{tmp_path}/store")
    local = tmp_path / "local"
    for step in (10, 20, 30, 40):
        commit(storage, local, step)
    # step 20: another rank's local marker still says failed (its retry had not run yet)
    write_marker(local, 20, 1, "failed", [], meta_for(20), error="outage")
    # step 10 cannot be deleted: a part of another job's upload sits in it
    storage.put_bytes(layout.part_key(10, 7), meta_part(10, 7))
    result = Catalog(storage, local, job_id=JOB_ID).apply_retention(keep_last=1)
    assert result.deleted == [20, 30]
    assert list(result.failed) == [10] and "not deleted" in result.failed[10]
    states = {c.step: c.state for c in Catalog(storage, local, job_id=JOB_ID).list()}
    assert states == {10: CkptState.COMMITTED, 40: CkptState.COMMITTED}


def meta_part(step: int, rank: int) -> bytes:
    from ds3d.checkpoints.manifest import PartManifest

    return PartManifest(step=step, rank=rank, job_id=new_job_id(), created=time.time(),
                        files=[]).model_dump_json().encode()


def test_a_listener_error_after_a_commit_does_not_fail_the_checkpoint(tmp_path: Path) -> None:
    """The commit listener runs retention; when it raised, the Uploader took the error for a
    failed upload of the checkpoint it had just committed (marker and event `failed`)."""
    storage = open_storage(f"file://{tmp_path}/store")
    local = tmp_path / "local"
    events: list[UploadEvent] = []

    def listener(ev: UploadEvent) -> None:
        events.append(ev)
        if ev.kind == "committed":
            raise RuntimeError("cleanup of an older step failed")

    up = Uploader(storage, local, 0, 1, on_event=listener, retry_interval=0.1)
    try:
        files = write_fake_checkpoint(local, 5)[0]
        up.submit(5, files, meta_for(5).model_copy(update={"job_id": JOB_ID}))
        assert up.wait(30)
        time.sleep(0.5)  # a retry would come after 0.1 s
    finally:
        up.close(10)
    assert [e.kind for e in events] == ["local_complete", "uploaded", "committed"]
    assert read_marker(layout.local_rank_marker(local, 5, 0))["state"] == "committed"  # type: ignore[index]
    assert up.failed() == [] and up.pending() == []


def test_a_listing_survives_a_step_deleted_under_it(tmp_path: Path, monkeypatch) -> None:
    """The local tier is shared by a node's ranks: another rank's rollback or retention may
    delete a step's files while this rank lists the catalog. The listing goes on without them
    (a CI run's spike drill died on a FileNotFoundError in the size count)."""
    import ds3d.checkpoints.catalog as catalog_module

    local = tmp_path / "local"
    write_fake_checkpoint(local, 2)
    write_fake_checkpoint(local, 4)
    real_walk = os.walk

    def walk_then_delete(top, *a, **kw):  # the folder's names are read, then a peer deletes
        for dirpath, dirs, names in list(real_walk(top, *a, **kw)):
            for name in names:
                if "global_step2" in str(dirpath):
                    (Path(dirpath) / name).unlink()
            yield dirpath, dirs, names

    monkeypatch.setattr(catalog_module.os, "walk", walk_then_delete)
    listed = {c.step: c for c in Catalog(open_storage(f"file://{tmp_path / 'store'}"), local,
                                         job_id=JOB_ID).list()}
    assert listed[2].state is CkptState.LOCAL and listed[2].size == 0
    assert listed[4].state is CkptState.LOCAL and listed[4].size > 0
