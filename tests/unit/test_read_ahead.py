"""Restore reads each local file once (checkpoints/read_ahead.py): in parallel chunks into host
memory, hashed against the sha256 recorded at save as the bytes stream, and DeepSpeed's loads
are served from those bytes. A file changed after its hash was recorded is caught by that same
pass and the restore falls back to an older step."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from ds3d.checkpoints import local_complete, manifest
from ds3d.checkpoints.engine_io import CheckpointManager, Rank
from ds3d.checkpoints.local_complete import write_record
from ds3d.checkpoints.manifest import FileEntry, file_entries, hash_file, hash_file_chunks
from ds3d.checkpoints.read_ahead import ReadAhead, load_buffer
from ds3d.checkpoints.settings import CheckpointSettings

from fixtures.ckpt import meta_for, write_fake_checkpoint


def entry(root: Path, rel: str) -> FileEntry:
    """An entry as versions before chunk hashes recorded it: one sha256 for the file."""
    path = root / rel
    return FileEntry(path=rel, size=path.stat().st_size, sha256=hash_file(path))


def chunked_entry(root: Path, rel: str, chunk: int) -> FileEntry:
    path = root / rel
    digest, pieces = hash_file_chunks(path, chunk_bytes=chunk, hashers=3)
    return FileEntry(path=rel, size=path.stat().st_size, sha256=digest, chunk_bytes=chunk,
                     chunk_sha256=pieces)


def test_chunk_hashes_are_the_pieces_sha256_and_the_file_hash_is_unchanged(
        tmp_path: Path) -> None:
    data = os.urandom(5 * (1 << 20) + 17)
    (tmp_path / "f").write_bytes(data)
    digest, pieces = hash_file_chunks(tmp_path / "f", chunk_bytes=1 << 20, hashers=2)
    assert digest == hashlib.sha256(data).hexdigest() == hash_file(tmp_path / "f")
    assert pieces == tuple(hashlib.sha256(data[o:o + (1 << 20)]).hexdigest()
                           for o in range(0, len(data), 1 << 20))
    assert len(pieces) == 6
    (tmp_path / "small").write_bytes(b"abc")
    abc = hashlib.sha256(b"abc").hexdigest()
    assert hash_file_chunks(tmp_path / "small") == (abc, (abc,))
    (tmp_path / "empty").write_bytes(b"")
    assert hash_file_chunks(tmp_path / "empty") == (hashlib.sha256(b"").hexdigest(), ())


def test_an_entry_whose_chunk_hashes_do_not_cover_the_file_is_refused() -> None:
    h = "0" * 64
    FileEntry(path="x", size=10, sha256=h, chunk_bytes=4, chunk_sha256=(h, h, h))
    with pytest.raises(ValueError,
                       match=r"3 chunk hashes for 8 bytes in pieces of 4 \(expected 2\)"):
        FileEntry(path="x", size=8, sha256=h, chunk_bytes=4, chunk_sha256=(h, h, h))
    with pytest.raises(ValueError, match="64 lower-case hex"):
        FileEntry(path="x", size=4, sha256=h, chunk_bytes=4, chunk_sha256=("A" * 64,))
    with pytest.raises(ValueError, match="expected 0"):
        FileEntry(path="x", size=4, sha256=h, chunk_sha256=(h,))


def test_each_reader_checks_its_piece_and_names_the_bad_one(tmp_path: Path) -> None:
    for name in ("changed.bin", "intact.bin"):
        (tmp_path / name).write_bytes(os.urandom((3 << 20) + 5))
    entries = [chunked_entry(tmp_path, p.name, 1 << 20) for p in sorted(tmp_path.iterdir())]
    result = ReadAhead(tmp_path, entries, readers=3).start().wait()
    assert result.ok and bytes(result.buffers[str(tmp_path / "changed.bin")]) == \
        (tmp_path / "changed.bin").read_bytes()
    with open(tmp_path / "changed.bin", "r+b") as fh:  # one byte of the third piece
        fh.seek((2 << 20) + 9)
        old = fh.read(1)
        fh.seek((2 << 20) + 9)
        fh.write(bytes([old[0] ^ 1]))
    result = ReadAhead(tmp_path, entries, readers=3).start().wait()
    assert set(result.bad) == {"changed.bin"}
    assert f"piece at byte {2 << 20}" in result.bad["changed.bin"]
    assert list(result.buffers) == [str(tmp_path / "intact.bin")]


def test_parallel_read_equals_the_file_bytes(tmp_path: Path) -> None:
    sizes = {"a.bin": 5 * (1 << 20) + 123, "b.bin": 1 << 20, "empty.bin": 0, "c.bin": 7}
    for name, n in sizes.items():
        (tmp_path / name).write_bytes(os.urandom(n))
    entries = [entry(tmp_path, name) for name in sizes]
    result = ReadAhead(tmp_path, entries, readers=3, chunk=1 << 20).start().wait()
    assert result.ok and result.nbytes == sum(sizes.values())
    for name in sizes:
        got = result.buffers[str(tmp_path / name)]
        assert bytes(got) == (tmp_path / name).read_bytes()


def test_a_file_changed_after_its_hash_was_recorded_is_detected(tmp_path: Path) -> None:
    for name in ("same_size.bin", "longer.bin", "gone.bin", "intact.bin"):
        (tmp_path / name).write_bytes(os.urandom(3 << 20))
    entries = [entry(tmp_path, p.name) for p in sorted(tmp_path.iterdir())]
    with open(tmp_path / "same_size.bin", "r+b") as fh:  # same size, one byte in the middle
        fh.seek(2 << 20)
        old = fh.read(1)
        fh.seek(2 << 20)
        fh.write(bytes([old[0] ^ 1]))
    with open(tmp_path / "longer.bin", "ab") as fh:
        fh.write(b"x")
    (tmp_path / "gone.bin").unlink()
    result = ReadAhead(tmp_path, entries, readers=2, chunk=1 << 20).start().wait()
    assert not result.ok
    assert set(result.bad) == {"same_size.bin", "longer.bin", "gone.bin"}
    assert "sha256" in result.bad["same_size.bin"] and "size" in result.bad["longer.bin"]
    assert list(result.buffers) == [str(tmp_path / "intact.bin")]


def test_load_buffer_gives_torch_load_without_copying(tmp_path: Path) -> None:
    state = {"w": torch.randn(300, 200), "opt": [torch.arange(7), 3, "adam"],
             "h": torch.randn(9).to(torch.bfloat16)}
    torch.save(state, tmp_path / "s.pt")
    result = ReadAhead(tmp_path, [entry(tmp_path, "s.pt")]).start().wait()
    view = result.buffers[str(tmp_path / "s.pt")]
    got = load_buffer(view, map_location=lambda storage, loc: storage)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["h"], state["h"])
    assert torch.equal(got["opt"][0], state["opt"][0]) and got["opt"][1:] == [3, "adam"]
    base = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    assert base <= got["w"].data_ptr() < base + len(view)  # a view of the verified bytes


def manager(run_dir: Path) -> CheckpointManager:
    settings = CheckpointSettings(job="test-job", store=None, local_dir=None, keep_last=5,
                                  keep_every=0, cleanup_grace_s=3600.0, model_hash="abc123",
                                  zero_stage=1)
    return CheckpointManager(settings, run_dir, Rank(0, 1, 0, 1, 1, 1), torch.device("cpu"),
                             lambda *a, **k: None)


def save_local(mgr: CheckpointManager, step: int) -> None:
    files = write_fake_checkpoint(mgr.local_dir, step, 1, size=3 << 20)[0]
    meta = meta_for(step).model_copy(update={"job_id": mgr.job_id})
    write_record(mgr.local_dir, step, 0, file_entries(mgr.local_dir, files), meta)


def test_restore_verifies_while_reading_and_falls_back_from_a_changed_file(
        tmp_path: Path, one_rank_group, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = manager(tmp_path)
    try:
        for step in (10, 20):
            save_local(mgr, step)

        def no_second_pass(path):
            raise AssertionError(f"{path} hashed again outside the read")
        monkeypatch.setattr(local_complete, "hash_file", no_second_pass)
        monkeypatch.setattr(manifest, "hash_file", no_second_pass)
        plan = mgr.plan_restore()
        assert plan is not None and plan.step == 20 and plan.read_ahead is not None
        plan = mgr.confirm(plan)
        assert plan is not None and plan.step == 20 and plan.read_ahead is None
        model = mgr.local_dir / "global_step20" / "mp_rank_00_model_states.pt"
        assert bytes(plan.buffers[str(model)]) == model.read_bytes()
        assert len(plan.buffers) == 4  # every file of the rank, each read once

        with open(model, "r+b") as fh:  # changed after the save hashed it, same size
            fh.seek(1 << 20)
            fh.write(b"\0" * 8)
        plan = mgr.confirm(mgr.plan_restore())
        assert plan is not None and plan.step == 10 and plan.excluded == frozenset({20})
        assert str(mgr.local_dir / "global_step10" / "mp_rank_00_model_states.pt") in \
            plan.buffers
    finally:
        mgr.close(timeout=10)
