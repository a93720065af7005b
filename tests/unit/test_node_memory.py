"""The snapshot arena in node memory (checkpoints/node_memory.py) and its validity marker, with
the real SnapshotCheckpointEngine on CPU (the arena is a MAP_SHARED file in a real tmpfs, not
page-locked; the carving, copies and marker are the GPU's).

Invariant under test: a marker exists only for a save whose host copies are all complete, it
is gone before the next save copies its first byte, and a marker is used only by the same
job, rank and layout with the same arena file. A new engine stands for the restarted worker
(a new process maps the same file: the mapping is shared, not copied)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from ds3d.checkpoints.node_memory import (
    Fingerprint,
    NodeArena,
    job_folder,
    no_room,
    remove_job_folder,
)
from ds3d.checkpoints.snapshot import SnapshotCheckpointEngine

pytest_plugins = ["fixtures.tmpfs", "fixtures.shm"]
pytestmark = pytest.mark.timeout(60)

FP = Fingerprint(job_id="a" * 32, rank=1, world_size=4, tp=2, pp=2, dp=1, model_hash="m1")
ARENA = 1 << 20


def _state(scale: float) -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32) * scale,
            "h": (torch.ones(7, 3) * scale).to(torch.bfloat16),
            "step": torch.tensor(int(scale)), "empty": torch.zeros(0),
            "groups": [torch.full((5,), scale, dtype=torch.float64)], "lr": 0.1,
            "size": torch.Size([3, 4])}


def _engine(root: Path, fp: Fingerprint = FP, nbytes: int = ARENA) -> SnapshotCheckpointEngine:
    engine = SnapshotCheckpointEngine(node=NodeArena(fp, root))
    engine.reserve_pinned(nbytes, pin=False)
    engine.wait_arena()
    return engine


def _info(tmp: Path, tag: str) -> CheckpointCommitInfo:
    return CheckpointCommitInfo(tag=tag, save_dir=str(tmp), save_latest=False)


def _save(engine: SnapshotCheckpointEngine, tmp: Path, step: int, scale: float) -> None:
    tag = f"global_step{step}"
    (tmp / tag).mkdir(parents=True, exist_ok=True)
    info = _info(tmp, tag)
    engine.create(info)
    engine.describe_next_save(step, f'{{"step": {step}}}')
    engine.save(_state(scale), str(tmp / tag / "model.pt"))
    engine.save({"opt": _state(scale + 1)}, str(tmp / tag / "optim.pt"))
    engine.commit(info)


def _same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple) and not isinstance(a, torch.Size):
        assert type(a) is type(b) and len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b, strict=True):  # type: ignore[call-overload]
            _same(x, y)
    else:
        assert a == b


def test_a_committed_save_is_adopted_whole_by_the_next_process(shm: Path, tmp_path: Path) -> None:
    engine = _engine(shm)
    node = NodeArena(FP, shm)
    assert node.arena_path.exists() and node.arena_path.stat().st_size == ARENA
    assert oct(node.folder.stat().st_mode & 0o777) == "0o700"
    _save(engine, tmp_path, 4, 4.0)
    assert node.marker_path.exists()
    engine.wait()

    restarted = SnapshotCheckpointEngine(node=NodeArena(FP, shm))
    held = restarted.adopt_node_memory(str(tmp_path))
    assert held == (4, '{"step": 4}')
    snap = restarted.held()
    assert snap is not None and snap.tag == "global_step4"
    files = {os.path.basename(p): s for p, s in snap.files.items()}
    _same(files["model.pt"], _state(4.0))
    _same(files["optim.pt"], {"opt": _state(5.0)})
    assert restarted.arena_adopted
    # its next save reuses the adopted arena (no second file) and replaces the marker
    _save(restarted, tmp_path, 8, 8.0)
    again = SnapshotCheckpointEngine(node=NodeArena(FP, shm)).adopt_node_memory(str(tmp_path))
    assert again is not None and again[0] == 8
    assert sorted(p.name for p in node.folder.iterdir()) == ["rank-00001.arena",
                                                              "rank-00001.held"]
    engine.close()
    restarted.close()


def test_the_marker_goes_before_the_first_byte_of_the_next_save(shm: Path,
                                                                tmp_path: Path) -> None:
    engine = _engine(shm)
    node = NodeArena(FP, shm)
    _save(engine, tmp_path, 4, 4.0)
    assert node.marker_path.exists()
    arena_before = node.arena_path.read_bytes()
    engine.create(_info(tmp_path, "global_step8"))
    # create() of the next save: no marker, and not one byte of the arena changed yet
    assert not node.marker_path.exists()
    assert node.arena_path.read_bytes() == arena_before
    engine.describe_next_save(8, "{}")
    (tmp_path / "global_step8").mkdir()
    engine.save(_state(8.0), str(tmp_path / "global_step8" / "model.pt"))
    assert node.arena_path.read_bytes() != arena_before  # copied over the held bytes
    # a crash here (the copies half done, no commit): the restart finds nothing to use
    assert SnapshotCheckpointEngine(node=NodeArena(FP, shm)).adopt_node_memory(
        str(tmp_path)) is None
    engine.commit(_info(tmp_path, "global_step8"))
    assert node.marker_path.exists()
    engine.close()


def test_a_save_the_arena_cannot_hold_is_never_marked(shm: Path, tmp_path: Path) -> None:
    engine = _engine(shm, nbytes=4096)  # the optimizer file's tensors get buffers of their own
    _save(engine, tmp_path, 4, 4.0)
    assert not NodeArena(FP, shm).marker_path.exists()
    engine.close()


@pytest.mark.parametrize("other", [
    Fingerprint(**{**FP.__dict__, "tp": 1, "pp": 4}),
    Fingerprint(**{**FP.__dict__, "world_size": 8}),
    Fingerprint(**{**FP.__dict__, "model_hash": "m2"}),
])
def test_another_layout_or_model_ignores_and_removes_the_held_copy(
        shm: Path, tmp_path: Path, other: Fingerprint) -> None:
    engine = _engine(shm)
    _save(engine, tmp_path, 4, 4.0)
    engine.wait()
    node = NodeArena(other, shm)
    assert SnapshotCheckpointEngine(node=node).adopt_node_memory(str(tmp_path)) is None
    assert not node.marker_path.exists() and not node.arena_path.exists()
    engine.close()


def test_another_job_never_sees_it(shm: Path, tmp_path: Path) -> None:
    engine = _engine(shm)
    _save(engine, tmp_path, 4, 4.0)
    other = Fingerprint(**{**FP.__dict__, "job_id": "b" * 32})
    assert job_folder(other.job_id, shm) != job_folder(FP.job_id, shm)
    assert SnapshotCheckpointEngine(node=NodeArena(other, shm)).adopt_node_memory(
        str(tmp_path)) is None
    assert NodeArena(FP, shm).marker_path.exists()
    assert [p.name for p in shm.iterdir()] == [job_folder(FP.job_id, shm).name]
    engine.close()
    assert remove_job_folder(FP.job_id, shm) and list(shm.iterdir()) == []
    assert not remove_job_folder(FP.job_id, shm)


def test_a_marker_naming_another_arena_file_or_torn_is_ignored(shm: Path,
                                                               tmp_path: Path) -> None:
    engine = _engine(shm)
    _save(engine, tmp_path, 4, 4.0)
    engine.wait()
    node = NodeArena(FP, shm)
    marker = node.marker_path.read_bytes()
    node.marker_path.write_bytes(marker[: len(marker) // 2])  # torn
    assert SnapshotCheckpointEngine(node=NodeArena(FP, shm)).adopt_node_memory(
        str(tmp_path)) is None
    assert not node.marker_path.exists()
    node.marker_path.write_bytes(marker)  # whole again, but the arena file is another one
    data = node.arena_path.read_bytes()
    node.arena_path.unlink()
    node.arena_path.write_bytes(data)
    assert SnapshotCheckpointEngine(node=NodeArena(FP, shm)).adopt_node_memory(
        str(tmp_path)) is None
    engine.close()


def test_ranks_beyond_a_smaller_world_are_removed(shm: Path) -> None:
    for rank in (1, 3):
        NodeArena(Fingerprint(**{**FP.__dict__, "rank": rank}), shm).create(4096)
    NodeArena(FP, shm).remove_ranks_from(2)
    assert [p.name for p in job_folder(FP.job_id, shm).iterdir()] == ["rank-00001.arena"]


def test_no_tmpfs_falls_back_to_process_memory(tmp_path: Path) -> None:
    """A folder on a disk file system is not node memory: the arena is anonymous, nothing is
    marked, the save itself works as before."""
    assert no_room(ARENA, tmp_path) is not None or pytest.skip("tmp_path is a tmpfs here")
    engine = _engine(tmp_path)
    assert engine._arena is not None and not NodeArena(FP, tmp_path).arena_path.exists()
    _save(engine, tmp_path / "ckpt", 4, 4.0)
    engine.wait()
    assert (tmp_path / "ckpt" / "global_step4" / "model.pt").exists()
    assert not NodeArena(FP, tmp_path).marker_path.exists()
    engine.close()


@pytest.mark.tmpfs
def test_a_64_mb_dev_shm_falls_back(small_tmpfs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A container's 64 MB /dev/shm: even a small arena is refused (the margin), nothing is
    left there, and saves use process memory."""
    shm = small_tmpfs(64 << 20)
    why = no_room(ARENA, shm)
    assert why is not None and "free" in why, why
    engine = _engine(shm)
    assert engine._arena is not None and list(shm.iterdir()) in ([], [job_folder(FP.job_id, shm)])
    assert not NodeArena(FP, shm).arena_path.exists()
    _save(engine, tmp_path, 4, 4.0)
    engine.close()
    # a tmpfs with room for the arena and its margin takes it
    roomy = small_tmpfs(ARENA + (80 << 20))
    assert no_room(ARENA, roomy) is None
    engine = _engine(roomy)
    assert NodeArena(FP, roomy).arena_path.stat().st_size == ARENA
    engine.close()


def _manager(run_dir: Path, keep: bool | str, dp: int = 1):  # type: ignore[no-untyped-def]
    from ds3d.checkpoints.engine_io import CheckpointManager, Rank
    from ds3d.checkpoints.settings import CheckpointSettings

    settings = CheckpointSettings(job="nm", store=None, local_dir=None, keep_last=5,
                                  keep_every=0, cleanup_grace_s=3600.0, model_hash="abc",
                                  zero_stage=1, keep_in_node_memory=keep)
    return CheckpointManager(settings, run_dir, Rank(0, 1, 0, 1, 1, dp), torch.device("cpu"),
                             lambda *a, **k: None)


def test_true_without_a_tmpfs_fails_at_start_and_auto_falls_back(
        tmp_path: Path, one_rank_group, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    assert no_room(ARENA, tmp_path) is not None or pytest.skip("tmp_path is a tmpfs here")
    monkeypatch.setenv("DS3D_NODE_MEMORY_ROOT", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    from ds3d.checkpoints.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"keep_in_node_memory = true, but .* not a tmpfs"):
        _manager(tmp_path / "a", True)
    auto = _manager(tmp_path / "b", "auto")
    try:
        assert auto.node is not None  # tried at the arena's reservation, falls back there
    finally:
        auto.close()
    off = _manager(tmp_path / "c", False)
    data_parallel = _manager(tmp_path / "d", "auto", dp=2)
    try:
        assert off.node is None and data_parallel.node is None
    finally:
        off.close()
        data_parallel.close()
