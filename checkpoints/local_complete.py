"""The first of a checkpoint's two commits: local-complete.

A step is *durable* once its MANIFEST is in the store (upload.py); that can take a minute, or
an outage's length. It is *local-complete* on a node as soon as every rank's files of the step
are on that node's disk and verified: each rank hashes its own files once, as they are written,
and records sizes and sha256 beside the upload marker (`L/.ds3d/step-N/local-rank-R.json`,
layout.py). The record is the rank's promise that these bytes are what it saved; a restart
reads them back without waiting for the store.

What "verified" means for a file hashed while written (hashing_writer.py, snapshot.py): its
hashes are of exactly the bytes this process handed to the kernel for it, in order; every
write, the flush and the fsync succeeded, the temp file was renamed into place, and its size on
disk equals the bytes hashed. A file without such hashes (its writer did more than append, or
another process wrote it: a backlog resumed after a restart) is hashed by reading it back after
the write. Neither proves the medium (a read right after the write comes from the page cache):
a restore checks every byte it reads against the record (read_ahead.py, `own_files_verify`).

Which checkpoint a restart uses (`agree_local_step`, then engine_io.plan_restore): the newest
step that is local-complete *for every rank* (each rank checks, on its own node's disk, every
saved rank's record and file sizes, and the sha256 of its own files), decided collectively so
all ranks load the same step; if the store holds a newer durable checkpoint, that one. A rank
whose node lost its copy (a replaced node, a wiped disk) or that cannot see another node's files
votes no, and the group falls back to the newest durable checkpoint. Only a group of the same
world size as the save uses a local copy (after an elastic resize, the store's copy).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from pydantic import BaseModel, ConfigDict, ValidationError

from . import layout
from .identity import manifest_is_mine
from .manifest import CheckpointMeta, FileEntry, Manifest, PartManifest, hash_file, merge_parts

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("ds3d.checkpoints.local_complete")


class LocalRecord(BaseModel):
    """One rank's files of one step, verified on this node's disk, and the save's metadata."""

    model_config = ConfigDict(extra="forbid")
    part: PartManifest
    meta: CheckpointMeta


def write_record(local_dir: str | Path, step: int, rank: int, entries: list[FileEntry],
                 meta: CheckpointMeta) -> None:
    """Atomically records that `rank`'s files of `step` are on disk with these hashes."""
    path = layout.local_complete_path(local_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = LocalRecord(part=PartManifest(step=step, rank=rank, job_id=meta.job_id,
                                        created=time.time(), files=entries), meta=meta)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(rec.model_dump_json())
    os.replace(tmp, path)


def read_record(local_dir: str | Path, step: int, rank: int) -> LocalRecord | None:
    try:
        return LocalRecord.model_validate_json(
            layout.local_complete_path(local_dir, step, rank).read_bytes())
    except (FileNotFoundError, ValidationError, json.JSONDecodeError):
        return None


def remove_record(local_dir: str | Path, step: int, rank: int) -> None:
    layout.local_complete_path(local_dir, step, rank).unlink(missing_ok=True)


def _recorded_steps(local_dir: Path) -> list[int]:
    steps = set()
    for p in (local_dir / layout.LOCAL_STATE_DIR).glob("step-*/local-rank-*.json"):
        try:
            steps.add(int(p.parent.name.removeprefix("step-")))
        except ValueError:
            continue
    return sorted(steps, reverse=True)


def _files_present(local_dir: Path, entries: list[FileEntry]) -> bool:
    for e in entries:
        try:
            if (local_dir / e.path).stat().st_size != e.size:
                return False
        except OSError:
            return False
    return True


def complete_here(local_dir: str | Path, step: int, world_size: int,
                  job_id: str | None) -> Manifest | None:
    """The step's manifest merged from every rank's record, when this node's disk holds all of
    them (this job's, saved by a group of `world_size`) with every file present at its recorded
    size; None otherwise. Hashes are not checked here (see `own_files_verify`)."""
    root = Path(local_dir)
    records = [read_record(root, step, r) for r in range(world_size)]
    if any(rec is None for rec in records):
        return None
    parts = [rec.part for rec in records if rec is not None]
    meta = records[0].meta if records[0] is not None else None
    if meta is None or meta.layout.world_size != world_size or \
            not all(manifest_is_mine(p.job_id, job_id) for p in parts):
        return None
    if not all(_files_present(root, p.files) for p in parts):
        return None
    try:
        return merge_parts(step, meta, parts)
    except ValueError:
        return None


def own_files_verify(local_dir: str | Path, step: int, rank: int) -> bool:
    """This rank's files of `step` still hash to what it recorded when it wrote them."""
    rec = read_record(local_dir, step, rank)
    if rec is None:
        return False
    root = Path(local_dir)
    for e in rec.part.files:
        try:
            if hash_file(root / e.path) != e.sha256:
                log.warning("local_copy_corrupt", step=step, rank=rank, path=e.path)
                return False
        except OSError:
            return False
    return True


def agree_local_step(local_dir: str | Path, rank: int, world_size: int, job_id: str | None,
                     device: torch.device, verify: bool = True,
                     exclude: frozenset[int] = frozenset()) -> tuple[int, Manifest | None]:
    """Collective: the newest step local-complete for every rank of this group, with its
    manifest as this rank's node sees it, or (-1, None).

    Every rank lists the steps its node holds whole (cheap: records and sizes); the newest step
    in all lists is the candidate; every rank then hashes its own files of it, and one MIN
    all-reduce accepts it or moves on to the next older common step. With `verify=False` the
    candidate is returned unhashed: the caller must check the hashes while it reads the files
    (read_ahead.py, engine_io.CheckpointManager.confirm) and exclude the step if they fail."""
    import torch  # here, not at the top: ds3dd imports this module and never needs torch
    import torch.distributed as dist

    root = Path(local_dir)
    whole = {s: m for s in _recorded_steps(root) if s not in exclude
             and (m := complete_here(root, s, world_size, job_id)) is not None}
    lists: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, sorted(whole))
    common = set(whole)
    for other in lists:
        common &= set(other or [])
    for step in sorted(common, reverse=True):
        if not verify:
            return step, whole[step]
        ok = torch.tensor([int(own_files_verify(root, step, rank))], dtype=torch.long,
                          device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item():
            return step, whole[step]
        log.warning("local_complete_rejected", step=step,
                    detail="a rank's files fail their recorded sha256")
    return -1, None
