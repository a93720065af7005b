"""A restore's read into the snapshot arena on a GPU (snapshot.ArenaLoan): once the read is
over the arena is registered with CUDA as one piece, so the loaded tensors are page-locked
(their host-to-device copies run at pinned speed, whatever pieces they would have crossed), the
load's state reaches the device bit for bit, and the next save is carved from the same arena.
Skipped on machines without CUDA (pytest -m gpu runs it there)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from ds3d.checkpoints.manifest import FileEntry, hash_file_chunks
from ds3d.checkpoints.read_ahead import ReadAhead
from ds3d.checkpoints.snapshot import SnapshotCheckpointEngine

pytestmark = [pytest.mark.gpu]

ARENA = 96 << 20


@pytest.mark.timeout(120)
def test_a_read_into_the_arena_loads_from_pinned_memory_then_serves_saves(
        tmp_path: Path) -> None:
    dev = torch.device("cuda", 0)
    state = {"w": torch.randn(4096, 4096, device=dev),  # 64 MiB: spans 16 MiB pieces
             "h": torch.randn(333, 77, device=dev).to(torch.bfloat16), "step": 7}
    writer = SnapshotCheckpointEngine()
    (tmp_path / "t").mkdir()
    info = CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=False)
    writer.create(info)
    writer.save(state, str(tmp_path / "t" / "model.pt"))
    writer.commit(info)
    writer.wait()
    writer.close()
    digest, pieces = hash_file_chunks(tmp_path / "t" / "model.pt", chunk_bytes=16 << 20)
    entry = FileEntry(path="t/model.pt", size=(tmp_path / "t" / "model.pt").stat().st_size,
                      sha256=digest, chunk_bytes=16 << 20, chunk_sha256=pieces)

    engine = SnapshotCheckpointEngine()
    engine._pin_piece = 16 << 20  # pieces smaller than the file: a lent arena is one piece
    loan = engine.lend_arena(ARENA)
    assert loan is not None
    engine.reserve_pinned(ARENA, pin=True)
    result = ReadAhead(tmp_path, [entry], into=loan).start().wait()
    engine.wait_arena()
    assert result.ok and result.placed
    assert engine._arena is loan.arena and len(engine._arena_pieces) == 1
    path = os.path.normpath(os.path.abspath(tmp_path / "t" / "model.pt"))
    with engine.serving_buffers(result.buffers):
        loaded = engine.load(path, map_location=torch.device("cpu"))
    assert loaded["w"].is_pinned()  # registered memory: the copy below is a DMA
    w = loaded["w"].to(dev)
    h = loaded["h"].to(dev)
    del loaded
    assert torch.equal(w, state["w"]) and torch.equal(h, state["h"])
    assert engine.end_loan({p: v for p, v in result.buffers.items() if p in result.placed})

    (tmp_path / "t2").mkdir()
    info = CheckpointCommitInfo(tag="t2", save_dir=str(tmp_path), save_latest=False)
    engine.create(info)
    engine.save({"w": w * 2}, str(tmp_path / "t2" / "model.pt"))
    engine.commit(info)
    engine.wait()
    got = torch.load(tmp_path / "t2" / "model.pt", weights_only=False)["w"]
    assert torch.equal(got.to(dev), w * 2)
    engine.close()
