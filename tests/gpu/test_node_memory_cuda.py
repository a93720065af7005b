"""Node memory on a GPU (checkpoints/node_memory.py): the snapshot arena is a MAP_SHARED file
in a tmpfs, page-locked with cudaHostRegister a piece at a time like the anonymous arena. A
save copies CUDA tensors into it (asynchronously, split at the pieces' edges, then the device
synchronised), the marker is written, and a second engine (the restarted worker) maps it back,
serves the state onto the device and registers the adopted arena again. Bit for bit.
Skipped on machines without CUDA (pytest -m gpu runs it there)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from ds3d.checkpoints.node_memory import Fingerprint, NodeArena, no_room
from ds3d.checkpoints.snapshot import SnapshotCheckpointEngine

pytestmark = [pytest.mark.gpu]

FP = Fingerprint(job_id="c" * 32, rank=0, world_size=1, tp=1, pp=1, dp=1, model_hash="m")
ARENA = 80 << 20


@pytest.mark.timeout(120)
def test_a_cuda_save_in_node_memory_is_restored_onto_the_device(tmp_path: Path) -> None:
    if no_room(ARENA, Path("/dev/shm")) is not None:
        pytest.skip(f"/dev/shm: {no_room(ARENA, Path('/dev/shm'))}")
    root = Path(tempfile.mkdtemp(prefix="ds3d-gpu-test-", dir="/dev/shm"))
    dev = torch.device("cuda", 0)
    state = {"w": torch.randn(4096, 1024, device=dev),          # 16 MiB: spans pieces
             "h": torch.randn(333, 77, device=dev).to(torch.bfloat16), "step": 7,
             "cpu": torch.arange(5)}
    try:
        engine = SnapshotCheckpointEngine(node=NodeArena(FP, root))
        engine._pin_piece = 1 << 20  # 1 MiB pieces: copies split at the pieces' edges
        engine.reserve_pinned(ARENA, pin=True)
        engine.wait_arena()
        assert engine._arena_pieces, "cudaHostRegister refused the shared tmpfs mapping"
        tag = "global_step7"
        (tmp_path / tag).mkdir()
        info = CheckpointCommitInfo(tag=tag, save_dir=str(tmp_path), save_latest=False)
        engine.create(info)
        engine.describe_next_save(7, "{}")
        engine.save(state, str(tmp_path / tag / "model.pt"))
        engine.commit(info)
        engine.wait()

        restarted = SnapshotCheckpointEngine(node=NodeArena(FP, root))
        assert restarted.adopt_node_memory(str(tmp_path)) == (7, "{}")
        with restarted.serving_held({}, dev) as stand_ins:
            got = restarted.load(os.path.join(stand_ins, tag, "model.pt"))
        assert got["w"].device == dev and torch.equal(got["w"], state["w"])
        assert torch.equal(got["h"].cuda(), state["h"]) and got["step"] == 7
        assert torch.equal(got["cpu"], state["cpu"])
        restarted.reserve_pinned(ARENA, pin=True)  # the adopted arena, registered again
        restarted.wait_arena()
        assert restarted._arena_pieces
        engine.close()
        restarted.close()
    finally:
        for p in sorted(root.rglob("*"), reverse=True):
            p.unlink() if not p.is_dir() else p.rmdir()
        root.rmdir()
