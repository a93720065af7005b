"""Retention keeps exactly what it promises: the last K committed, every Nth as a milestone, the
newest always; uncommitted, partial and corrupt steps are never deleted by it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog, CkptState
from ds3d.checkpoints.file_storage import FileStorage
from ds3d.checkpoints.retention import plan_retention
from ds3d.checkpoints.upload import commit_checkpoint, upload_rank_files

from fixtures.ckpt import meta_for, write_fake_checkpoint

pytestmark = pytest.mark.timeout(60)


def expected_kept(steps: list[int], keep_last: int, keep_every: int) -> set[int]:
    return set(steps[-keep_last:]) | {s for s in steps if keep_every and s % keep_every == 0}


def test_plan_basics() -> None:
    assert plan_retention([], 3, 0) == []
    assert plan_retention([5], 1, 0) == []
    assert plan_retention([10, 20, 30, 40], 2, 0) == [10, 20]
    assert plan_retention([10, 20, 30, 40], 1, 20) == [10, 30]
    assert plan_retention([40, 10, 30, 20, 20], 2, 0) == [10, 20]  # any order, duplicates
    assert plan_retention([10, 20, 30, 40], 1, 0, protect=[20]) == [10, 30]
    with pytest.raises(ValueError):
        plan_retention([1], 0, 0)
    with pytest.raises(ValueError):
        plan_retention([1], 1, -1)


@pytest.mark.parametrize(("keep_last", "keep_every"), [(1, 0), (3, 0), (3, 50), (2, 30), (25, 7)])
def test_plan_never_drops_newest_or_milestones(keep_last: int, keep_every: int) -> None:
    steps: list[int] = []
    for s in range(10, 210, 10):
        steps.append(s)
        doomed = plan_retention(steps, keep_last, keep_every)
        assert max(steps) not in doomed
        assert set(steps) - set(doomed) == expected_kept(steps, keep_last, keep_every)
        steps = [x for x in steps if x not in doomed]


def save(store: FileStorage, local: Path, step: int) -> None:
    files = write_fake_checkpoint(local, step, world_size=2, size=64)
    for rank, paths in files.items():
        upload_rank_files(store, step, rank, local, paths)
    commit_checkpoint(store, step, 2, meta_for(step, 2), timeout=5, poll_interval=0.01)
    for rank in files:
        layout.local_rank_marker(local, step, rank).parent.mkdir(parents=True, exist_ok=True)


def test_twenty_saves_keep_exactly_the_promise(tmp_path: Path) -> None:
    store, local = FileStorage(tmp_path / "store"), tmp_path / "local"
    catalog = Catalog(store, local)
    # A partial upload and a corrupt checkpoint from earlier crashes: retention leaves them.
    write_fake_checkpoint(local, 5, size=64)
    upload_rank_files(store, 5, 0, local, [f"{layout.default_tag(5)}/mp_rank_00_model_states.pt"])
    save(store, local, 7)
    store.delete([layout.file_key(7, f"{layout.default_tag(7)}/mp_rank_00_model_states.pt")])

    done: list[int] = []
    for step in range(10, 210, 10):
        save(store, local, step)
        done.append(step)
        deleted = catalog.apply_retention(keep_last=3, keep_every=50).deleted
        want = expected_kept(done, 3, 50)
        done = sorted(want)
        states = {c.step: c.state for c in catalog.list()}
        assert {s for s, st in states.items() if st is CkptState.COMMITTED} == want
        assert states[5] is CkptState.UPLOADING and states[7] is CkptState.CORRUPT
        for s in deleted:
            assert not store.list(layout.step_prefix(s))
            assert not (local / layout.default_tag(s)).exists()
            assert not layout.local_state_dir(local, s).exists()
    assert done == [50, 100, 150, 180, 190, 200]
    assert sorted(int(p.name.removeprefix("global_step")) for p in local.glob("global_step*")) \
        == [5, 7, 50, 100, 150, 180, 190, 200]
