"""What a checkpoint is: its manifest (JSON), the per-rank parts it is merged from, and checksums.

The manifest is the only proof that a checkpoint is complete: it lists every file with its size
and sha256, the parallel layout it was saved in, and where training was (step, tokens, data
position), so a restore can refuse a layout or model it cannot load and resume the data stream
exactly. Paths are relative to the local checkpoint folder (DeepSpeed's `global_stepN/...`).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .atomic_file import replace_file
from .layout import check_rel_path, file_key, local_manifest_path

FORMAT_VERSION = 1
HASH_CHUNK = 8 << 20
# The pieces each file's `chunk_sha256` covers: a restore checks a file's pieces on as many
# threads as it reads them with (read_ahead.py) instead of one sequential sha256 per file.
CHUNK_BYTES = 64 << 20
CHUNK_HASHERS = 4


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_SHA256 = r"^[0-9a-f]{64}$"


class FileEntry(_Model):
    path: str = Field(description="relative to the checkpoint folder, POSIX separators")
    size: int = Field(ge=0, description="bytes")
    sha256: str = Field(pattern=_SHA256)
    chunk_bytes: int = Field(default=0, ge=0, description="size of the pieces `chunk_sha256` "
                             "hashes (the last may be shorter); 0 in entries of older versions")
    chunk_sha256: tuple[str, ...] = Field(default=(), description="sha256 of each piece, in order")

    @field_validator("path")
    @classmethod
    def _stays_in_the_checkpoint(cls, v: str) -> str:
        """A manifest or part read from the store names files inside its checkpoint only: a
        `..` or absolute path would read (or, restored, write) outside it."""
        if check_rel_path(v) != v:
            raise ValueError(f"checkpoint file path {v!r} is not in its plain form")
        return v

    @model_validator(mode="after")
    def _chunks_cover_the_file(self) -> FileEntry:
        want = -(-self.size // self.chunk_bytes) if self.chunk_bytes else 0
        if len(self.chunk_sha256) != want:
            raise ValueError(f"{self.path}: {len(self.chunk_sha256)} chunk hashes for {self.size} "
                             f"bytes in pieces of {self.chunk_bytes} (expected {want})")
        if any(len(h) != 64 or h.strip("0123456789abcdef") for h in self.chunk_sha256):
            raise ValueError(f"{self.path}: a chunk hash is not 64 lower-case hex digits")
        return self

    def same_bytes(self, other: FileEntry) -> bool:
        """Both entries describe the same file content (chunk hashes may be absent in one)."""
        return (self.path, self.size, self.sha256) == (other.path, other.size, other.sha256)


class Layout(_Model):
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    dp: int = Field(ge=1)
    world_size: int = Field(ge=1)


class CheckpointMeta(_Model):
    """Everything about a checkpoint except its files: given by the trainer at save time."""

    job: str
    job_id: str | None = Field(default=None, description="the saving job's unique id "
                               "(identity.py); None only in markers of older versions")
    tokens_seen: int = Field(default=0, ge=0)
    tag: str = Field(description="DeepSpeed tag, the sub-folder its files live in")
    layout: Layout
    model_hash: str = ""
    data_position: dict[str, Any] = Field(default_factory=dict)


class PartManifest(_Model):
    """One rank's files, written by that rank after they are uploaded."""

    format_version: int = FORMAT_VERSION
    step: int = Field(ge=0)
    rank: int = Field(ge=0)
    job_id: str | None = Field(default=None, description="the uploading job's unique id")
    created: float = Field(description="unix seconds")
    files: list[FileEntry]


class Manifest(_Model):
    format_version: int = FORMAT_VERSION
    job: str
    job_id: str | None = Field(default=None, description="unique id of the job that committed "
                               "it (identity.py); None in manifests of older versions, which "
                               "belong to whoever owns the prefix")
    step: int = Field(ge=0)
    tokens_seen: int = Field(ge=0)
    tag: str
    created: float = Field(description="unix seconds when the manifest was built")
    layout: Layout
    model_hash: str
    data_position: dict[str, Any]
    ds3d_version: str
    deepspeed_version: str
    files: list[FileEntry]

    @model_validator(mode="after")
    def _each_file_once(self) -> Manifest:
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            twice = next(p for i, p in enumerate(paths) if p in paths[:i])
            raise ValueError(f"{twice} is listed twice")
        return self

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        return cls.model_validate_json(data)


def versions() -> tuple[str, str]:
    """(ds3d, deepspeed) versions from package metadata: no import of deepspeed (it is slow)."""
    out = []
    for dist in ("ds3d", "deepspeed"):
        try:
            out.append(metadata.version(dist))
        except metadata.PackageNotFoundError:
            out.append("unknown")
    return out[0], out[1]


def hash_file(path: str | Path) -> str:
    """sha256 of a file, read in 8 MiB chunks so memory stays flat for 10 GB shards."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def hash_file_chunks(path: str | Path, chunk_bytes: int = CHUNK_BYTES,
                     hashers: int = CHUNK_HASHERS) -> tuple[str, tuple[str, ...]]:
    """(sha256 of the file, sha256 of each `chunk_bytes` piece) in one read: the whole-file
    hash follows the reads in order, the pieces are hashed by a pool beside it (hashlib releases
    the GIL), so this takes about as long as `hash_file`. Memory: hashers + 1 pieces."""
    whole = hashlib.sha256()
    size = os.path.getsize(path)
    if size <= chunk_bytes:  # one piece: its hash is the file's
        digest = hash_file(path)
        return digest, (digest,) if size else ()
    pieces: list[str] = []
    with open(path, "rb", buffering=0) as fh, \
            ThreadPoolExecutor(hashers, thread_name_prefix="ckpt-chunk-hash") as pool:
        pending: deque[Future[str]] = deque()
        for off in range(0, size, chunk_bytes):
            buf = bytearray(min(chunk_bytes, size - off))
            view, got = memoryview(buf), 0
            while got < len(buf):
                n = fh.readinto(view[got:])
                if not n:
                    raise OSError(f"{path} ended at {off + got} bytes while hashed (changed?)")
                got += n
            whole.update(buf)
            pending.append(pool.submit(_sha256_hex, buf))
            while len(pending) > hashers:
                pieces.append(pending.popleft().result())
        pieces.extend(f.result() for f in pending)
    return whole.hexdigest(), tuple(pieces)


def _sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def list_checkpoint_files(local_dir: str | Path, tag: str) -> list[str]:
    """Relative paths of every regular file under `local_dir/tag`, sorted."""
    root = Path(local_dir)
    out = []
    for dirpath, _dirs, names in os.walk(root / tag):
        for name in names:
            full = Path(dirpath) / name
            if full.is_file() and not name.startswith(".tmp-ds3d-"):
                out.append(full.relative_to(root).as_posix())
    return sorted(out)


def file_entries(local_dir: str | Path, files: list[str],
                 known: Mapping[str, FileEntry] | None = None) -> list[FileEntry]:
    """Each file's size, sha256 and piece hashes, by reading it. `known`: entries by path
    already taken (a file hashed while it was written, hashing_writer.py), used as they are
    for a file whose size on disk is still theirs."""
    root = Path(local_dir)
    entries = []
    for rel in sorted(set(files)):
        rel = check_rel_path(rel)
        full = root / rel
        entry = known.get(rel) if known else None
        if entry is not None and entry.size == full.stat().st_size:
            entries.append(entry)
            continue
        digest, pieces = hash_file_chunks(full)
        entries.append(FileEntry(path=rel, size=full.stat().st_size, sha256=digest,
                                 chunk_bytes=CHUNK_BYTES, chunk_sha256=pieces))
    return entries


def build_manifest(local_dir: str | Path, step: int, meta: CheckpointMeta,
                   files: list[str] | None = None) -> Manifest:
    """Manifest of a checkpoint held whole in one local folder (one node, or a shared disk).
    `files` defaults to everything under `local_dir/meta.tag`."""
    if files is None:
        files = list_checkpoint_files(local_dir, meta.tag)
    return manifest_from_entries(step, meta, file_entries(local_dir, files))


def manifest_from_entries(step: int, meta: CheckpointMeta, entries: list[FileEntry]) -> Manifest:
    ds3d_version, ds_version = versions()
    return Manifest(
        job=meta.job, job_id=meta.job_id, step=step, tokens_seen=meta.tokens_seen, tag=meta.tag,
        created=time.time(), layout=meta.layout, model_hash=meta.model_hash,
        data_position=meta.data_position, ds3d_version=ds3d_version,
        deepspeed_version=ds_version, files=sorted(entries, key=lambda e: e.path))


def merge_parts(step: int, meta: CheckpointMeta, parts: list[PartManifest]) -> Manifest:
    """Merges the ranks' parts; a path listed by two ranks must be the same bytes."""
    by_path: dict[str, FileEntry] = {}
    for part in parts:
        if part.step != step:
            raise ValueError(f"part of rank {part.rank} is for step {part.step}, not {step}")
        if part.job_id is not None and meta.job_id is not None and part.job_id != meta.job_id:
            raise ValueError(f"part of rank {part.rank} was written by job id {part.job_id}, "
                             f"not by this job ({meta.job_id}): two jobs share the prefix")
        for entry in part.files:
            seen = by_path.setdefault(entry.path, entry)
            if not seen.same_bytes(entry):
                raise ValueError(f"{entry.path} differs between ranks' parts "
                                 f"({seen.sha256[:12]} vs {entry.sha256[:12]})")
    return manifest_from_entries(step, meta, list(by_path.values()))


def size_problems(step: int, manifest: Manifest, objects: dict[str, int]) -> list[str]:
    """The manifest's files that the store's listing (key -> size) lacks or holds at another
    size (empty: every file is there at its size)."""
    problems = []
    for entry in manifest.files:
        size = objects.get(file_key(step, entry.path))
        if size is None:
            problems.append(f"{entry.path}: missing in the store")
        elif size != entry.size:
            problems.append(f"{entry.path}: {size} bytes in the store, manifest says {entry.size}")
    return problems


def verify_local(local_dir: str | Path, manifest: Manifest, checksums: bool = True,
                 only: set[str] | None = None) -> list[str]:
    """Problems of the local copy against the manifest (empty = it matches). Sizes always,
    sha256 when `checksums`; `only` restricts to some paths (a node's own shards)."""
    root = Path(local_dir)
    problems = []
    for entry in manifest.files:
        if only is not None and entry.path not in only:
            continue
        full = root / entry.path
        try:
            size = full.stat().st_size
        except FileNotFoundError:
            problems.append(f"{entry.path}: missing")
            continue
        if size != entry.size:
            problems.append(f"{entry.path}: {size} bytes, manifest says {entry.size}")
        elif checksums and hash_file(full) != entry.sha256:
            problems.append(f"{entry.path}: sha256 differs from the manifest")
    return problems


def save_local_manifest(local_dir: str | Path, manifest: Manifest) -> None:
    """Keeps a copy of a committed manifest in the local tier (restore during a store outage)."""
    path = local_manifest_path(local_dir, manifest.step)
    data = manifest.to_json()
    if path.is_file() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, data)  # every rank of a node restores into one folder
