"""Hashing while writing (checkpoints/hashing_writer.py): the hashes the writer takes equal a
read back of the file (`hash_file_chunks`) whatever the sizes and the shape of the writes; the
snapshot writer hands them to the uploader, which then records a save local-complete without
reading its files back, and reads back every file it has no such hash for."""

from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path

import pytest
import torch

from ds3d.checkpoints.hashing_writer import SMALL_WRITE, HashingWriter, WrittenSave
from ds3d.checkpoints.identity import new_job_id
from ds3d.checkpoints.local_complete import own_files_verify, read_record
from ds3d.checkpoints.manifest import CHUNK_BYTES, hash_file_chunks
from ds3d.checkpoints.snapshot import SnapshotCheckpointEngine
from ds3d.checkpoints.storage import open_storage
from ds3d.checkpoints.upload import Uploader, UploadEvent

from fixtures.ckpt import meta_for

pytest_plugins = ["fixtures.tmpfs"]
pytestmark = pytest.mark.timeout(120)

PIECE = 2 << 20  # a small piece size keeps the raw-write cases fast; the last test uses 64 MiB


class _Info:
    def __init__(self, tag: str) -> None:
        self.tag = tag


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _write_through(path: Path, writes: list[tuple[int, bool]], piece: int) -> bytes:
    """Writes random blocks of the given sizes through a HashingWriter, each from memory it
    declares stable or not; a block not declared stable is overwritten as soon as `write`
    returns, so a hash read after that would differ. Returns the bytes the file must hold."""
    blocks = [bytearray(os.urandom(n)) for n, _ in writes]
    stable = [(_address(b), len(b)) for b, (_n, s) in zip(blocks, writes, strict=True)
              if s and len(b)]
    expected = b"".join(bytes(b) for b in blocks)
    with open(path, "wb") as fh, HashingWriter(fh, stable, chunk_bytes=piece) as w:
        for block in blocks:
            assert w.write(memoryview(block)) == len(block)
            if not any(a == _address(block) for a, _ in stable) and len(block):
                block[:] = b"\xff" * len(block)  # the caller reuses its memory
        fh.flush()
        digest = w.digest()
    assert digest is not None and w.unknown is None
    assert path.read_bytes() == expected
    assert digest.size == len(expected) and digest.chunk_bytes == piece
    assert (digest.sha256, digest.chunk_sha256) == hash_file_chunks(path, piece)
    return expected


@pytest.mark.parametrize("writes", [
    [],                                                   # empty file: no pieces
    [(0, False), (30, False)],                            # a few bytes, one piece
    [(PIECE - 1, True)],                                  # just under one piece
    [(PIECE, True), (PIECE, True)],                       # exactly 2 pieces, stable memory
    [(PIECE, False), (PIECE, False), (PIECE, False)],     # exactly 3 pieces, caller's memory
    [(3 * PIECE + 5, True), (17, False)],                 # 3 pieces + a tail
    [(100, False)] * 30 + [(PIECE + 3, True), (77, False), (2 * PIECE - 1, False),
                           (SMALL_WRITE - 1, False), (PIECE // 2, True)],  # mixed, unaligned
], ids=["empty", "tiny", "under-one", "two-exact", "three-exact-unstable", "three-plus-tail",
        "mixed"])
def test_digest_equals_a_read_back(tmp_path: Path, writes: list[tuple[int, bool]]) -> None:
    data = _write_through(tmp_path / "f", writes, PIECE)
    if not data:
        assert hash_file_chunks(tmp_path / "f", PIECE) == (hashlib.sha256(b"").hexdigest(), ())


def test_many_small_writes_past_the_copy_budget(tmp_path: Path) -> None:
    _write_through(tmp_path / "f", [(SMALL_WRITE // 2 + 7, False)] * 140, PIECE)  # ~70 MiB


def test_torch_save_only_appends(tmp_path: Path) -> None:
    """The premise: torch.save into a file object calls nothing but write and flush (a seek
    or any other call would leave `unknown` set, and the save would be read back instead)."""
    state = {"w": torch.randn(1 << 20), "opt": [torch.zeros(3, 5), {"step": 7}], "name": "x"}
    with open(tmp_path / "f.pt", "wb") as fh, HashingWriter(fh) as w:
        torch.save(state, w)
        fh.flush()
        digest = w.digest()
    assert w.unknown is None and digest is not None
    assert (digest.sha256, digest.chunk_sha256) == hash_file_chunks(tmp_path / "f.pt")
    loaded = torch.load(tmp_path / "f.pt", weights_only=False)
    assert torch.equal(loaded["w"], state["w"]) and loaded["opt"][1] == {"step": 7}


def test_a_seek_leaves_no_digest(tmp_path: Path) -> None:
    with open(tmp_path / "f", "wb") as fh, HashingWriter(fh) as w:
        w.write(b"abcdef")
        w.seek(0)
        w.write(b"X")
        fh.flush()
        assert w.digest() is None and "seek" in (w.unknown or "")


def _save(engine: SnapshotCheckpointEngine, folder: Path, tag: str,
          state: dict[str, torch.Tensor]) -> list[str]:
    (folder / tag).mkdir(parents=True, exist_ok=True)
    engine.create(_Info(tag))  # type: ignore[arg-type]
    path = str(folder / tag / "mp_rank_00_model_states.pt")
    engine.save(state, path)
    engine.commit(_Info(tag))  # type: ignore[arg-type]
    engine.wait()
    return [path]


def _upload(tmp_path: Path, local: Path, step: int, files: list[str],
            written: WrittenSave | None) -> list[UploadEvent]:
    events: list[UploadEvent] = []
    up = Uploader(open_storage(f"file://{tmp_path}/store"), local, 0, 1, on_event=events.append)
    try:
        up.submit(step, files, meta_for(step).model_copy(update={"job_id": new_job_id()}),
                  written=written)
        assert up.wait(60)
    finally:
        up.close(10)
    return events


def test_the_writers_hashes_are_recorded_without_reading_the_file_back(tmp_path: Path) -> None:
    """A byte changed on disk between the write and the record shows which bytes were hashed:
    with the writer's hashes the record holds those of the bytes written (and the restore's
    check then catches the change); without them the file is read back."""
    local = tmp_path / "local"
    got: list[WrittenSave | None] = []
    engine = SnapshotCheckpointEngine(on_durable=lambda tag, paths: got.append(engine.written(tag)))
    state = {"w": torch.randn((CHUNK_BYTES + (3 << 20)) // 4)}  # 64 MiB pieces: 1 + a tail
    try:
        [path] = _save(engine, local, "global_step5", state)
    finally:
        engine.close()
    [written] = got
    assert written is not None and engine.written("global_step5") is None  # only in the callback
    w = written.files[path]
    assert w.digest is not None and len(w.digest.chunk_sha256) == 2
    assert (w.digest.sha256, w.digest.chunk_sha256) == hash_file_chunks(path)
    assert written.write_s >= w.write_s > 0

    as_written = hash_file_chunks(path)
    with open(path, "r+b") as fh:  # same size, other bytes
        fh.seek(1000)
        old = fh.read(8)
        fh.seek(1000)
        fh.write(bytes(x ^ 0xFF for x in old))
    changed = hash_file_chunks(path)
    assert changed != as_written
    rel = os.path.relpath(path, local)

    events = _upload(tmp_path, local, 5, [rel], written)
    [entry] = read_record(local, 5, 0).part.files  # type: ignore[union-attr]
    assert (entry.sha256, entry.chunk_sha256) == as_written  # not read back
    assert not own_files_verify(local, 5, 0)  # a restore's check still sees the change
    done = next(e for e in events if e.kind == "local_complete")
    assert done.timings["hash_s"] == 0.0 and done.timings["read_back_files"] == 0
    assert done.timings["write_s"] > 0
    assert done.timings["local_complete_s"] >= done.timings["write_s"] - 0.01
    assert "hashed while written" in done.detail

    events = _upload(tmp_path, local, 6, [rel], None)  # no writer's hashes: read back
    [entry] = read_record(local, 6, 0).part.files  # type: ignore[union-attr]
    assert (entry.sha256, entry.chunk_sha256) == changed
    done = next(e for e in events if e.kind == "local_complete")
    assert done.timings["read_back_files"] == 1 and "write_s" not in done.timings


def test_a_file_not_the_size_written_is_read_back(tmp_path: Path) -> None:
    local = tmp_path / "local"
    got: list[WrittenSave | None] = []
    engine = SnapshotCheckpointEngine(on_durable=lambda tag, paths: got.append(engine.written(tag)))
    try:
        [path] = _save(engine, local, "global_step7", {"w": torch.randn(1000)})
    finally:
        engine.close()
    with open(path, "ab") as fh:
        fh.write(b"appended")
    events = _upload(tmp_path, local, 7, [os.path.relpath(path, local)], got[0])
    [entry] = read_record(local, 7, 0).part.files  # type: ignore[union-attr]
    assert (entry.sha256, entry.chunk_sha256) == hash_file_chunks(path)
    assert entry.size == os.path.getsize(path)
    done = next(e for e in events if e.kind == "local_complete")
    assert done.timings["read_back_files"] == 1 and "read back" in done.detail


def test_without_hashing_while_writing_the_writer_gives_no_digest(tmp_path: Path) -> None:
    got: list[WrittenSave | None] = []
    engine = SnapshotCheckpointEngine(on_durable=lambda tag, paths: got.append(engine.written(tag)),
                                      hash_while_writing=False)
    try:
        [path] = _save(engine, tmp_path, "global_step1", {"w": torch.randn(1000)})
    finally:
        engine.close()
    assert got[0] is not None and got[0].files[path].digest is None


@pytest.mark.tmpfs
def test_a_disk_full_save_is_abandoned_and_the_next_has_only_its_own_hashes(
        small_tmpfs, fill_disk) -> None:
    disk = small_tmpfs(16 << 20)
    got: list[tuple[str, WrittenSave | None]] = []
    failed: list[str] = []
    engine = SnapshotCheckpointEngine(
        on_durable=lambda tag, paths: got.append((tag, engine.written(tag))),
        on_failed=lambda tag, *a: failed.append(tag))
    try:
        filler = fill_disk(disk, leave=1 << 20)
        _save(engine, disk, "global_step10", {"w": torch.randn(1 << 20)})  # 4 MiB: no room
        assert failed == ["global_step10"] and got == []
        assert not (disk / "global_step10").exists()  # no file, no temp file
        filler.unlink()
        [path] = _save(engine, disk, "global_step20", {"w": torch.randn(1 << 20)})
    finally:
        engine.close()
    [(tag, written)] = got
    assert tag == "global_step20" and written is not None and list(written.files) == [path]
    digest = written.files[path].digest
    assert digest is not None and (digest.sha256, digest.chunk_sha256) == hash_file_chunks(path)
