"""A restore's read into the snapshot arena (snapshot.ArenaLoan, read_ahead.py `into`): the
files land in the arena itself, verified as before; the arena's reservation waits for the read
and takes that same memory; after the load the read's views are released, and an arena whose
bytes a loaded tensor still uses is given up rather than overwritten by the next save. On a GPU
the arena is then registered whole; here (CPU) the same paths run unpinned."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from ds3d.checkpoints.manifest import FileEntry, hash_file_chunks
from ds3d.checkpoints.read_ahead import ALIGN, ReadAhead
from ds3d.checkpoints.snapshot import SnapshotCheckpointEngine

ARENA = 8 << 20


def _entry(root: Path, rel: str, chunk: int = 1 << 20) -> FileEntry:
    digest, pieces = hash_file_chunks(root / rel, chunk_bytes=chunk, hashers=2)
    return FileEntry(path=rel, size=(root / rel).stat().st_size, sha256=digest,
                     chunk_bytes=chunk, chunk_sha256=pieces)


def _files(root: Path) -> tuple[list[FileEntry], dict[str, bytes]]:
    state = {"w": torch.arange(300_000, dtype=torch.float32), "step": torch.tensor(9)}
    torch.save(state, root / "model.pt")
    (root / "odd.bin").write_bytes(os.urandom(5000))  # not a multiple of ALIGN
    (root / "empty.bin").write_bytes(b"")
    names = ["odd.bin", "model.pt", "empty.bin"]
    return [_entry(root, n) for n in names], {n: (root / n).read_bytes() for n in names}


def _arena_range(engine: SnapshotCheckpointEngine) -> tuple[int, int]:
    probe = torch.frombuffer(engine._arena, dtype=torch.uint8, count=1)
    start = probe.data_ptr()
    del probe
    return start, start + len(engine._arena)


def test_the_read_lands_in_the_arena_that_the_reservation_then_takes(tmp_path: Path) -> None:
    entries, data = _files(tmp_path)
    engine = SnapshotCheckpointEngine()
    loan = engine.lend_arena(ARENA)
    assert loan is not None and engine.lend_arena(ARENA) is None  # lent once
    engine.reserve_pinned(ARENA, pin=False)  # what a restore starts beside the read
    result = ReadAhead(tmp_path, entries, readers=3, into=loan).start().wait()
    engine.wait_arena()
    assert result.ok and loan.finished.is_set() and loan.registered.is_set()
    paths = {n: os.path.normpath(os.path.abspath(tmp_path / n)) for n in data}
    assert result.placed == frozenset(paths.values())
    assert engine._arena is loan.arena  # the reservation took the memory the read filled
    start, end = _arena_range(engine)
    offsets = []
    for name, path in paths.items():
        view = result.buffers[path]
        assert bytes(view) == data[name]
        if len(view):
            address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
            assert start <= address and address + len(view) <= end
            assert (address - start) % ALIGN == 0
            offsets.append((address - start, len(view)))
    offsets.sort()
    assert all(a + n <= b for (a, n), (b, _) in zip(offsets, offsets[1:], strict=False))

    with engine.serving_buffers(result.buffers):  # as CheckpointManager.load serves DeepSpeed
        loaded = engine.load(paths["model.pt"])
    w = loaded["w"].clone()  # what DeepSpeed does on a GPU: copies onto the device
    del loaded
    assert engine.end_loan({p: v for p, v in result.buffers.items() if p in result.placed})
    for view in result.buffers.values():
        try:
            len(view)
            raise AssertionError("a view of the read outlived the loan")
        except ValueError:  # released: "operation forbidden on released memoryview object"
            pass
    # the next save is carved from the same arena, over the read's bytes
    save_dir = tmp_path / "saves"
    (save_dir / "t1").mkdir(parents=True)
    info = CheckpointCommitInfo(tag="t1", save_dir=str(save_dir), save_latest=False)
    engine.create(info)
    engine.save({"w": w * 2}, str(save_dir / "t1" / "model.pt"))
    engine.commit(info)
    engine.wait()
    buf = next(iter(engine._buffers.values()))
    assert start <= buf.data_ptr() < end and torch.equal(buf, w * 2)
    assert torch.equal(torch.load(save_dir / "t1" / "model.pt")["w"], w * 2)
    del buf
    engine.close()


def test_a_loaded_tensor_still_on_the_reads_bytes_keeps_them_from_the_next_save(
        tmp_path: Path) -> None:
    entries, _ = _files(tmp_path)
    engine = SnapshotCheckpointEngine()
    loan = engine.lend_arena(ARENA)
    engine.reserve_pinned(ARENA, pin=False)
    result = ReadAhead(tmp_path, entries, into=loan).start().wait()
    model = os.path.normpath(os.path.abspath(tmp_path / "model.pt"))
    with engine.serving_buffers(result.buffers):
        kept = engine.load(model)["w"]  # e.g. an optimizer state left on the host
    before = kept.clone()
    assert engine.end_loan({p: v for p, v in result.buffers.items() if p in result.placed}) \
        is False
    assert engine._arena is None and engine._slots[0].refused
    (tmp_path / "saves" / "t1").mkdir(parents=True)
    info = CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path / "saves"), save_latest=False)
    engine.create(info)
    engine.save({"w": torch.full((300_000,), 7.0)}, str(tmp_path / "saves" / "t1" / "model.pt"))
    engine.commit(info)
    engine.wait()
    assert torch.equal(kept, before)  # the save went into a buffer of its own
    engine.close()


def test_a_read_that_does_not_fit_the_arena_uses_buffers_of_its_own(tmp_path: Path) -> None:
    entries, data = _files(tmp_path)
    engine = SnapshotCheckpointEngine()
    loan = engine.lend_arena(64 << 10)  # smaller than the files
    assert loan is not None
    engine.reserve_pinned(64 << 10, pin=False)
    result = ReadAhead(tmp_path, entries, into=loan).start().wait()
    engine.wait_arena()
    assert result.ok and result.placed == frozenset() and loan.arena is None
    assert engine._arena is not None and len(engine._arena) == 64 << 10  # made as usual
    assert {bytes(v) for v in result.buffers.values()} == set(data.values())
    assert engine.end_loan({})
    engine.close()


def test_the_reservation_waits_for_a_failed_read_and_no_arena_is_lent_twice(
        tmp_path: Path) -> None:
    entries, _ = _files(tmp_path)
    (tmp_path / "model.pt").write_bytes(b"changed after its hash was recorded")
    engine = SnapshotCheckpointEngine()
    loan = engine.lend_arena(ARENA)
    assert loan is not None
    engine.reserve_pinned(ARENA, pin=False)
    assert not engine.arena_ready()  # waiting for the read
    result = ReadAhead(tmp_path, entries, into=loan).start().wait()
    assert not result.ok and "model.pt" in result.bad
    engine.wait_arena()
    assert engine._arena is loan.arena
    assert engine.lend_arena(ARENA) is None  # a second plan's read gets buffers of its own
    engine.close()


def test_no_loan_where_the_arena_is_already_there() -> None:
    engine = SnapshotCheckpointEngine()
    engine.reserve_pinned(1 << 20, pin=False)
    engine.wait_arena()
    assert engine.lend_arena(1 << 20) is None  # reserved already (or adopted from node memory)
    engine.close()
    idle = SnapshotCheckpointEngine()
    assert idle.end_loan({}) is True  # nothing lent: nothing to end
    idle.close()
    assert threading.active_count() >= 1
