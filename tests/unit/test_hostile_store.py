"""What a tampered store holds is validated before use (a hostile-store probe, 2026-12-06): a
MANIFEST path that leaves the checkpoint, a file listed twice, a MANIFEST of another step or
one that leaves out a rank's file make the checkpoint corrupt or incomplete (listed as such,
skipped by the restore for the newest good one), never an INTERNAL error or a worker crash;
a dead MANIFEST of a skipped checkpoint does not block a new save of its step; a symbolic link
out of a file store is not read through."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog, CkptState
from ds3d.checkpoints.errors import NotFoundError
from ds3d.checkpoints.file_storage import FileStorage
from ds3d.checkpoints.upload import commit_checkpoint, upload_rank_files

from fixtures.ckpt import meta_for, write_fake_checkpoint

pytestmark = pytest.mark.timeout(60)


def save(store: FileStorage, local: Path, step: int, world: int = 2, size: int = 64) -> None:
    files = write_fake_checkpoint(local, step, world_size=world, size=size)
    for rank, paths in files.items():
        upload_rank_files(store, step, rank, local, paths)
    commit_checkpoint(store, step, world, meta_for(step, world), timeout=5, poll_interval=0.01)


def edit_manifest(store: FileStorage, step: int, change) -> None:
    key = layout.manifest_key(step)
    data = json.loads(store.get_bytes(key))
    change(data)
    store.put_bytes(key, json.dumps(data).encode())


def setup(tmp_path: Path) -> tuple[FileStorage, Path, Catalog, list[tuple[int, str, str]]]:
    store, local = FileStorage(tmp_path / "store"), tmp_path / "local"
    save(store, local, 10)
    save(store, local, 20)
    skipped: list[tuple[int, str, str]] = []
    restore_into = tmp_path / "restore"  # a replaced node: nothing local, all from the store
    catalog = Catalog(store, restore_into, on_skip=lambda *a: skipped.append(a))
    return store, local, catalog, skipped


def state_of(catalog: Catalog, step: int) -> tuple[CkptState, list[str]]:
    info = next(i for i in catalog.list() if i.step == step)
    return info.state, info.problems


@pytest.mark.parametrize("path", ["../../../../outside/x.pt", "/tmp/outside.pt",
                                  "global_step20/./x.pt", "global_step20\\..\\..\\x.pt"])
def test_a_manifest_path_out_of_the_checkpoint_is_corrupt_and_skipped(tmp_path, path):
    store, _local, catalog, skipped = setup(tmp_path)
    edit_manifest(store, 20, lambda d: d["files"][0].update(path=path))
    state, problems = state_of(catalog, 20)
    assert state is CkptState.CORRUPT and "MANIFEST is unreadable" in problems[0], problems
    found = catalog.newest_restorable()
    assert found is not None and found.step == 10
    assert skipped and skipped[0][:2] == (20, "unreadable")


def test_a_file_listed_twice_is_corrupt(tmp_path):
    store, _local, catalog, _ = setup(tmp_path)
    edit_manifest(store, 20, lambda d: d["files"].append(dict(d["files"][0])))
    state, problems = state_of(catalog, 20)
    assert state is CkptState.CORRUPT and "listed twice" in problems[0], problems


def test_a_manifest_of_another_step_is_corrupt_and_named_by_its_folder(tmp_path):
    store, _local, catalog, skipped = setup(tmp_path)
    edit_manifest(store, 20, lambda d: d.update(step=300))
    state, problems = state_of(catalog, 20)
    assert state is CkptState.CORRUPT and "says step 300" in problems[0], problems
    found = catalog.newest_restorable()
    assert found is not None and found.step == 10
    assert skipped[0][0] == 20  # not "step 300"


def test_a_manifest_that_leaves_out_a_ranks_file_is_incomplete(tmp_path):
    """Every size and hash of what it lists checks out: only the ranks' parts show the hole,
    which DeepSpeed's load met on every restart until the job failed."""
    store, _local, catalog, skipped = setup(tmp_path)
    edit_manifest(store, 20, lambda d: d["files"].pop())
    assert catalog.verify(20) and "is not in the MANIFEST" in catalog.verify(20)[0]
    found = catalog.newest_restorable()
    assert found is not None and found.step == 10
    assert skipped[0][:2] == (20, "incomplete") and "is not in the MANIFEST" in skipped[0][2]
    assert catalog.verify(10) == []


def test_a_new_save_replaces_a_dead_manifest_of_its_step(tmp_path):
    """The restore skipped step 20 (its MANIFEST says step 300); the new timeline saves step 20
    again: the commit was refused ("a different MANIFEST is already committed") on every retry
    and the job waited for the store until it was stopped."""
    store, local, catalog, _ = setup(tmp_path)
    edit_manifest(store, 20, lambda d: d.update(step=300))
    save(store, local, 20)
    assert state_of(catalog, 20)[0] is CkptState.COMMITTED


def test_a_save_replaces_a_checkpoint_whose_file_is_gone_but_never_a_live_one(tmp_path):
    from ds3d.checkpoints.errors import CheckpointError

    store, local, catalog, _ = setup(tmp_path)
    manifest = catalog.load_manifest(20)
    store.delete([layout.file_key(20, manifest.files[0].path)])  # the restore skips it
    save(store, local, 20)  # the step trained again: new bytes, the same sizes
    assert state_of(catalog, 20)[0] is CkptState.COMMITTED
    assert catalog.verify(20, checksums=True) == []
    with pytest.raises(CheckpointError, match="already committed"):  # a live one is kept
        save(store, tmp_path / "elsewhere", 20, size=128)  # (not the files the store links)


def test_a_restore_uncommits_a_checkpoint_whose_stored_bytes_rotted(tmp_path):
    """A stored file of step 20 rots at the same size: every cheap check passes, only its
    sha256 fails. The training restore skips it and deletes its MANIFEST, so the step trained
    again (other bytes: GPU nondeterminism) commits instead of being refused on every retry
    ("already committed with other files"), and no later restore downloads it again. A
    read-only caller (verify, export) leaves the MANIFEST alone."""
    store, local, catalog, skipped = setup(tmp_path)
    manifest = catalog.load_manifest(20)
    rotten = tmp_path / "store" / layout.file_key(20, manifest.files[0].path)
    data = bytearray(rotten.read_bytes())
    data[len(data) // 2] ^= 0x40
    rotten.write_bytes(bytes(data))
    assert catalog.newest_restorable(checksums=True, download=True).step == 10  # read-only
    assert state_of(catalog, 20)[0] is CkptState.COMMITTED
    found = catalog.newest_restorable(checksums=True, download=True, uncommit_corrupt=True)
    assert found is not None and found.step == 10
    assert skipped[-1][:2] == (20, "corrupt") and "MANIFEST is deleted" in skipped[-1][2]
    assert not store.exists(layout.manifest_key(20))
    save(store, tmp_path / "retrained", 20)  # new bytes, the same sizes
    assert state_of(catalog, 20)[0] is CkptState.COMMITTED
    assert catalog.verify(20, checksums=True) == []


def test_a_symbolic_link_out_of_a_file_store_is_not_read(tmp_path):
    store, _local, catalog, _ = setup(tmp_path)
    manifest = catalog.load_manifest(20)
    key = layout.file_key(20, manifest.files[0].path)
    target = tmp_path / "outside.pt"
    path = tmp_path / "store" / key
    target.write_bytes(path.read_bytes())
    path.unlink()
    os.symlink(target, path)
    assert key not in {o.key for o in store.list(layout.step_prefix(20))}
    with pytest.raises(NotFoundError, match="outside the store"):
        store.get_bytes(key)
    state, problems = state_of(catalog, 20)
    assert state is CkptState.CORRUPT and "missing in the store" in problems[0]
