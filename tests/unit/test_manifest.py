"""Manifests: streamed hashing, building from a DeepSpeed-shaped folder, merging per-rank parts,
and detecting every way a local copy can differ (missing, truncated, bit-flipped)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from ds3d.checkpoints import layout
from ds3d.checkpoints.manifest import (
    FileEntry,
    Manifest,
    PartManifest,
    build_manifest,
    file_entries,
    hash_file,
    merge_parts,
    verify_local,
)

from fixtures.ckpt import meta_for, write_fake_checkpoint

pytestmark = pytest.mark.timeout(60)


def test_hash_file_streams_large_files(tmp_path: Path) -> None:
    data = os.urandom((8 << 20) * 2 + 123)  # crosses two chunk boundaries
    (tmp_path / "f").write_bytes(data)
    assert hash_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert hash_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_build_manifest_keeps_subfolders_and_roundtrips(tmp_path: Path) -> None:
    files = write_fake_checkpoint(tmp_path, 100, world_size=2)
    m = build_manifest(tmp_path, 100, meta_for(100, 2))
    paths = [f.path for f in m.files]
    assert paths == sorted(files[0] + files[1])
    assert "global_step100/extra/client_state.json" in paths
    assert m.layout.world_size == 2 and m.step == 100 and m.tokens_seen == 100_000
    assert m.total_size == sum((tmp_path / p).stat().st_size for p in paths)
    assert m.deepspeed_version != "" and m.ds3d_version != ""
    assert Manifest.from_json(m.to_json()) == m
    assert verify_local(tmp_path, m) == []


def test_verify_local_finds_each_problem(tmp_path: Path) -> None:
    write_fake_checkpoint(tmp_path, 5, world_size=2)
    m = build_manifest(tmp_path, 5, meta_for(5, 2))
    missing, truncated, flipped = (tmp_path / f.path for f in m.files[:3])
    missing.unlink()
    with open(truncated, "r+b") as fh:
        fh.truncate(10)
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    flipped.write_bytes(bytes(raw))
    problems = verify_local(tmp_path, m)
    assert len(problems) == 3
    assert "missing" in problems[0] and "10 bytes" in problems[1] and "sha256" in problems[2]
    # Sizes only: the bit flip is invisible, the others are not.
    assert len(verify_local(tmp_path, m, checksums=False)) == 2
    # Restricted to one node's files.
    assert verify_local(tmp_path, m, only={m.files[3].path}) == []


def test_merge_parts(tmp_path: Path) -> None:
    files = write_fake_checkpoint(tmp_path, 7, world_size=3)
    parts = [PartManifest(step=7, rank=r, created=0.0, files=file_entries(tmp_path, files[r]))
             for r in range(3)]
    # A file listed by two ranks (e.g. replicated) is fine when identical.
    dup = parts[1].model_copy(update={"files": parts[1].files + parts[0].files[:1]})
    m = merge_parts(7, meta_for(7, 3), [parts[0], dup, parts[2]])
    assert m == m.model_copy(update={"created": m.created})
    assert [f.path for f in m.files] == sorted(files[0] + files[1] + files[2])
    assert m.files == build_manifest(tmp_path, 7, meta_for(7, 3)).files

    bad = parts[2].model_copy(update={"files": [FileEntry(
        path=parts[0].files[0].path, size=1, sha256="0" * 64)]})
    with pytest.raises(ValueError, match="differs between ranks"):
        merge_parts(7, meta_for(7, 3), [parts[0], bad])
    with pytest.raises(ValueError, match="step 8"):
        merge_parts(7, meta_for(7, 3), [parts[0].model_copy(update={"step": 8})])


def test_paths_cannot_escape(tmp_path: Path) -> None:
    for bad in ("../etc/passwd", "/abs", "a/../../b", ".ds3d/x", ""):
        with pytest.raises(ValueError):
            layout.check_rel_path(bad)
    assert layout.check_rel_path("global_step1\\x.pt") == "global_step1/x.pt"


def test_layout_keys_are_fixed() -> None:
    assert layout.file_key(100, "global_step100/a/b.pt") == \
        "ckpt/step-00000100/files/global_step100/a/b.pt"
    assert layout.part_key(100, 3) == "ckpt/step-00000100/parts/rank-00003.json"
    assert layout.manifest_key(100) == "ckpt/step-00000100/MANIFEST.json"
    assert layout.LATEST_KEY == "latest"
    assert layout.step_of_key("ckpt/step-00000100/MANIFEST.json") == 100
    assert layout.step_of_key("latest") is None
    assert layout.rank_of_part_key(layout.part_key(100, 12)) == 12
