"""Memory-only snapshots (checkpoint.memory_interval) and the snapshot engine's two arena slots,
with the real SnapshotCheckpointEngine on CPU (arenas as MAP_SHARED files in /dev/shm, as on a
GPU node, only not page-locked).

What is asserted: a memory-only snapshot never waits for the writer (it copies into the slot
the writer is not reading, while a durable save's writes are held up for real by an
`on_durable` that blocks the writer thread), writes nothing and makes no folder; the other
slot's held snapshot stays valid while a new one is copied; each slot's marker goes before the
first byte of a new save lands in it; a restarted engine adopts both slots and picks the
newest valid; cleanup removes both slots' files; the config refuses settings that cannot work.
"""

from __future__ import annotations

import os
import threading
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
from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import ConfigError

pytest_plugins = ["fixtures.tmpfs", "fixtures.shm"]
pytestmark = pytest.mark.timeout(60)

FP = Fingerprint(job_id="c" * 32, rank=0, world_size=1, tp=1, pp=1, dp=1, model_hash="m1")
ARENA = 1 << 20


def _state(scale: float) -> dict[str, object]:
    return {"w": torch.arange(1000, dtype=torch.float32) * scale,
            "h": (torch.ones(7, 3) * scale).to(torch.bfloat16), "lr": 0.1}


def _engine(root: Path, on_durable=None) -> SnapshotCheckpointEngine:  # type: ignore[no-untyped-def]
    engine = SnapshotCheckpointEngine(on_durable=on_durable, node=NodeArena(FP, root), slots=2)
    engine.reserve_pinned(ARENA, pin=False)
    engine.wait_arena()
    return engine


def _durable_then_memory_only(engine: SnapshotCheckpointEngine, ckpt: Path) -> None:
    """Step 4's durable save (its writes finished), then step 6's memory-only snapshot: both
    slots hold a state."""
    _save(engine, ckpt, 4)
    engine.wait()
    _save(engine, ckpt, 6, memory_only=True)


def _save(engine: SnapshotCheckpointEngine, ckpt: Path, step: int,
          memory_only: bool = False) -> None:
    """What DeepSpeed's save_checkpoint calls on the engine, for one file."""
    tag = f"global_step{step}"
    info = CheckpointCommitInfo(tag=tag, save_dir=str(ckpt), save_latest=False)

    def calls() -> None:
        engine.makedirs(str(ckpt / tag), exist_ok=True)
        engine.create(info)
        engine.describe_next_save(step, f'{{"step": {step}}}')
        engine.save(_state(float(step)), str(ckpt / tag / "model.pt"))
        engine.commit(info)

    if memory_only:
        with engine.memory_only():
            calls()
    else:
        calls()


def _held_steps(engine: SnapshotCheckpointEngine) -> list[tuple[int, bool]]:
    return [(h.step, h.durable) for h in engine.held_snapshots()]


def _model(engine: SnapshotCheckpointEngine, step: int) -> torch.Tensor:
    held = next(h for h in engine.held_snapshots() if h.step == step)
    (state,) = held.files.values()
    return state["w"]


def test_a_memory_snapshot_never_waits_for_the_writer_and_writes_nothing(
        shm: Path, tmp_path: Path) -> None:
    """The durable save of step 4 is held up on the writer thread (its `on_durable` blocks):
    memory-only snapshots of steps 6 and 8 copy into the other slot at once, the second over
    the first, and step 4's copy stays valid throughout."""
    release, entered, durable = threading.Event(), threading.Event(), []

    def on_durable(tag: str, paths: list[str]) -> None:
        entered.set()
        release.wait(30)
        durable.append(tag)

    engine = _engine(shm, on_durable)
    ckpt = tmp_path / "ckpt"
    try:
        _save(engine, ckpt, 4)
        assert entered.wait(10) and engine.busy()  # the writer is inside step 4's commit
        for step in (6, 8):
            saver = threading.Thread(target=_save, args=(engine, ckpt, step, True))
            saver.start()
            saver.join(10)
            assert not saver.is_alive(), f"memory-only snapshot {step} waited for the writer"
            assert engine.busy() and not release.is_set()
            assert not (ckpt / f"global_step{step}").exists()  # no folder, no file
            assert _held_steps(engine) == [(step, False), (4, True)]
            assert torch.equal(_model(engine, 4), _state(4.0)["w"])
            assert torch.equal(_model(engine, step), _state(float(step))["w"])
        release.set()
        engine.wait()
        assert durable == ["global_step4"]  # nothing was handed on for 6 or 8
        assert sorted(os.listdir(ckpt)) == ["global_step4"]
        # the writer is idle: a durable save waits for nothing and takes the older slot (4)
        _save(engine, ckpt, 10)
        assert _held_steps(engine) == [(10, True), (8, False)]
        engine.wait()
    finally:
        release.set()
        engine.close()


def test_each_slot_marker_goes_before_the_first_byte_lands_in_it(shm: Path,
                                                                 tmp_path: Path) -> None:
    """Saves 4 (durable) and 6 (memory-only) fill both slots; the next memory-only snapshot
    takes the older slot (4's): its marker is gone at create(), before any byte changed,
    while slot 1's marker (6) stays; a crash mid-copy leaves 6 for the restart."""
    engine = _engine(shm)
    slot0, slot1 = NodeArena(FP, shm), NodeArena(FP, shm, slot=1)
    ckpt = tmp_path / "ckpt"
    _durable_then_memory_only(engine, ckpt)
    assert slot0.marker_path.exists() and slot1.marker_path.exists()
    before = slot0.arena_path.read_bytes()
    info = CheckpointCommitInfo(tag="global_step8", save_dir=str(ckpt), save_latest=False)
    with engine.memory_only():
        engine.create(info)
        assert not slot0.marker_path.exists() and slot1.marker_path.exists()
        assert slot0.arena_path.read_bytes() == before
        engine.describe_next_save(8, '{"step": 8}')
        engine.save(_state(8.0), str(ckpt / "global_step8" / "model.pt"))
        assert slot0.arena_path.read_bytes() != before
        # a crash here: the restart finds 6 (slot 1) and nothing in slot 0
        crashed = SnapshotCheckpointEngine(node=NodeArena(FP, shm), slots=2)
        assert crashed.adopt_node_memory(str(ckpt)) == (6, '{"step": 6}')
        assert _held_steps(crashed) == [(6, False)]
        engine.commit(info)
    assert slot0.marker_path.exists()
    engine.close()


def test_a_restart_adopts_both_slots_and_uses_the_newest_valid(shm: Path,
                                                               tmp_path: Path) -> None:
    engine = _engine(shm)
    ckpt = tmp_path / "ckpt"
    _durable_then_memory_only(engine, ckpt)
    restarted = SnapshotCheckpointEngine(node=NodeArena(FP, shm), slots=2)
    assert restarted.adopt_node_memory(str(ckpt)) == (6, '{"step": 6}')
    assert _held_steps(restarted) == [(6, False), (4, True)]
    assert torch.equal(_model(restarted, 6), _state(6.0)["w"])
    assert torch.equal(_model(restarted, 4), _state(4.0)["w"])
    # a rollback to 4 forgets 6 (and its marker): a crash must never come back to it
    restarted.forget_held(unless_tag="global_step4", older_kept=4)
    assert _held_steps(restarted) == [(4, True)]
    assert not NodeArena(FP, shm, slot=1).marker_path.exists()
    engine.close()
    restarted.close()


def test_a_torn_newer_slot_leaves_the_older_one_adopted(shm: Path, tmp_path: Path) -> None:
    engine = _engine(shm)
    ckpt = tmp_path / "ckpt"
    _durable_then_memory_only(engine, ckpt)
    newer = NodeArena(FP, shm, slot=1).marker_path
    newer.write_bytes(newer.read_bytes()[:40])
    restarted = SnapshotCheckpointEngine(node=NodeArena(FP, shm), slots=2)
    assert restarted.adopt_node_memory(str(ckpt)) == (4, '{"step": 4}')
    assert _held_steps(restarted) == [(4, True)]
    engine.close()
    restarted.close()


def test_cleanup_covers_both_slots(shm: Path, tmp_path: Path) -> None:
    engine = _engine(shm)
    ckpt = tmp_path / "ckpt"
    _durable_then_memory_only(engine, ckpt)
    folder = job_folder(FP.job_id, shm)
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank-00000-1.arena", "rank-00000-1.held", "rank-00000.arena", "rank-00000.held"]
    NodeArena(FP, shm).remove_slots_from(1)  # a start without memory snapshots
    assert sorted(p.name for p in folder.iterdir()) == ["rank-00000.arena", "rank-00000.held"]
    engine.release_node_memory()  # a clean exit
    assert not folder.exists()
    engine.close()
    for rank in (0, 1):
        for slot in (0, 1):
            NodeArena(Fingerprint(**{**FP.__dict__, "rank": rank}), shm, slot).create(4096)
    NodeArena(FP, shm).remove_ranks_from(1)
    assert sorted(p.name for p in folder.iterdir()) == ["rank-00000-1.arena", "rank-00000.arena"]
    assert remove_job_folder(FP.job_id, shm) and not folder.exists()


def _manager(run_dir: Path, dp: int = 1):  # type: ignore[no-untyped-def]
    from ds3d.checkpoints.engine_io import CheckpointManager, Rank
    from ds3d.checkpoints.settings import CheckpointSettings

    settings = CheckpointSettings(job="ms", store=None, local_dir=None, keep_last=5,
                                  keep_every=0, cleanup_grace_s=3600.0, model_hash="abc",
                                  zero_stage=1, keep_in_node_memory="auto", memory_interval=2)
    records: list[dict[str, object]] = []
    manager = CheckpointManager(settings, run_dir, Rank(0, 1, 0, 1, 1, dp), torch.device("cpu"),
                                lambda kind, **fields: records.append({"kind": kind, **fields}))
    return manager, records


@pytest.mark.tmpfs
def test_node_memory_with_room_for_one_arena_turns_memory_snapshots_off(  # type: ignore[no-untyped-def]
        small_tmpfs, tmp_path: Path, one_rank_group, monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for one arena and its margin, not two: memory-only snapshots are off on every
    rank, said once (log line and record); the one arena stays in node memory. With room for
    both they stay on; data-parallel size > 1 turns them off at once."""
    tight = small_tmpfs((64 << 20) + (ARENA * 3 // 2))
    assert no_room(ARENA, tight) is None and no_room(2 * ARENA, tight) is not None
    monkeypatch.setenv("DS3D_NODE_MEMORY_ROOT", str(tight))
    manager, records = _manager(tmp_path / "a")
    try:
        assert manager.memory_snapshots and manager.snapshot.slots == 2
        manager._agree_room_for_two(ARENA)
        assert not manager.memory_snapshots and manager.snapshot.slots == 1
        (off,) = [r for r in records if r.get("phase") == "memory_snapshots_off"]
        assert off["cause"] == "node_memory_room" and "room for one snapshot arena" in \
            str(off["detail"]) and "2x this rank's state" in str(off["detail"])
    finally:
        manager.close()
    roomy = small_tmpfs((64 << 20) + 4 * ARENA)
    monkeypatch.setenv("DS3D_NODE_MEMORY_ROOT", str(roomy))
    manager, records = _manager(tmp_path / "b")
    try:
        manager._agree_room_for_two(ARENA)
        assert manager.memory_snapshots and manager.snapshot.slots == 2 and records == []
    finally:
        manager.close()
    manager, records = _manager(tmp_path / "c", dp=2)
    try:
        assert not manager.memory_snapshots and manager.snapshot.slots == 1
        assert [r["cause"] for r in records] == ["data_parallel"]
    finally:
        manager.close()


def test_one_slot_refuses_a_memory_only_snapshot() -> None:
    engine = SnapshotCheckpointEngine()
    try:
        with pytest.raises(Exception, match="two arena slots"), engine.memory_only():
            pass
    finally:
        engine.close()


@pytest.mark.parametrize(("sets", "phrases"), [
    (["checkpoint.memory_interval=5"], ["checkpoint.memory_interval=5", "checkpoint.interval=0",
                                        "e.g. 20", "memory_interval = 0"]),
    (["checkpoint.interval=10", "checkpoint.memory_interval=10"],
     ["memory_interval=10 is not smaller than checkpoint.interval=10", "below 10", "e.g. 2"]),
    (["checkpoint.interval=10", "checkpoint.memory_interval=25"], ["not smaller"]),
    (["checkpoint.interval=10", "checkpoint.memory_interval=-1"],
     ["checkpoint.memory_interval", "greater than or equal to 0"]),
    (["checkpoint.interval=10", "checkpoint.memory_interval=\"3\""],
     ["checkpoint.memory_interval"]),
])
def test_memory_interval_is_refused_with_what_to_change(sets: list[str],
                                                        phrases: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        build_job_config("tiny", sets)
    for phrase in phrases:
        assert phrase in str(err.value), (phrase, str(err.value))


def test_memory_interval_below_an_integer_or_auto_interval_is_accepted() -> None:
    cfg = build_job_config("tiny", ["checkpoint.interval=10", "checkpoint.memory_interval=3"])
    assert cfg.checkpoint_settings().memory_interval == 3
    auto = build_job_config("tiny", ['checkpoint.interval="auto"', "checkpoint.memory_interval=7"])
    assert auto.checkpoint.memory_interval == 7
    assert build_job_config("tiny", []).checkpoint_settings().memory_interval == 0
