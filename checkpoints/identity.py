"""Which job a store prefix and its checkpoints belong to.

Names are not identities: two jobs can end up on one prefix (a name that normalises to another,
`nl\\n` -> `nl` once a URL parser drops the newline; two daemons given the same store and job
name). So each job gets a unique id when it is created (ds3dd: a uuid in its job row and in the
job directory's `job_id` file; a plain torchrun run: made once in its run directory), and:

- the prefix's owner is the object `P/JOB-ID`, created once with a conditional put by the first
  job that writes there, and never replaced;
- every MANIFEST (and part manifest) names the job id that wrote it;
- a job refuses to start on a prefix owned by another id (ds3dd's preflight, before anything is
  created, and the workers again before their first write), and never loads, overwrites or
  deletes a checkpoint whose manifest names another id.

Older versions wrote neither the marker nor ids in manifests. Rule for them: a manifest without
a job id belongs to whoever owns the prefix; the first job (of this version) that writes to a
prefix without a marker claims it, so an existing job upgraded in place keeps its checkpoints.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from . import layout
from .errors import CheckpointError, NotFoundError
from .storage import Storage

JOB_ID_FILE = "job_id"  # in the job's run directory (daemon/jobdir.py)


class ForeignPrefixError(CheckpointError):
    """The store prefix, or a checkpoint in it, belongs to another job."""


@dataclass(frozen=True)
class Owner:
    job_id: str
    job: str
    created: float

    def describe(self) -> str:
        return f"job {self.job!r} (id {self.job_id})"


def new_job_id() -> str:
    return uuid.uuid4().hex


def read_owner(storage: Storage) -> Owner | None:
    """The prefix's owner, or None when no job of this version has written there."""
    try:
        data = storage.get_bytes(layout.JOB_ID_KEY)
    except NotFoundError:
        return None
    try:
        rec = json.loads(data)
        return Owner(str(rec["job_id"]), str(rec.get("job", "")), float(rec.get("created", 0)))
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{storage.url}/{layout.JOB_ID_KEY} is unreadable, so the owner "
                              "of this prefix is unknown; delete that object only if no other "
                              "job uses the prefix, or use another checkpoint.store") from None


def check_owner(storage: Storage, job_id: str, job: str) -> Owner | None:
    """Read-only check (preflight): ForeignPrefixError if another job owns the prefix."""
    owner = read_owner(storage)
    if owner is not None and owner.job_id != job_id:
        raise foreign_prefix(storage, owner, job_id, job)
    return owner


def claim_prefix(storage: Storage, job_id: str, job: str) -> Owner:
    """Makes this job the owner of the prefix unless another job already is (then
    ForeignPrefixError, naming both). Safe to repeat; a race between two jobs has one winner."""
    owner = check_owner(storage, job_id, job)
    if owner is not None:
        return owner
    mine = Owner(job_id, job, time.time())
    storage.put_bytes(layout.JOB_ID_KEY, json.dumps(mine.__dict__).encode(), if_absent=True)
    # read back: the other job may have won, or the store may ignore the condition
    owner = read_owner(storage)
    if owner is None or owner.job_id != job_id:
        raise foreign_prefix(storage, owner or mine, job_id, job)
    return owner


def foreign_prefix(storage: Storage, owner: Owner, job_id: str, job: str) -> ForeignPrefixError:
    return ForeignPrefixError(
        f"checkpoint store {storage.url} belongs to {owner.describe()}, not to job {job!r} "
        f"(id {job_id}); its checkpoints are neither loaded, overwritten nor deleted by this "
        "job. Give this job another checkpoint.store or name; remove the other job's prefix "
        "only if it is really gone")


def manifest_is_mine(manifest_job_id: str | None, job_id: str | None) -> bool:
    """A checkpoint belongs to this job when its manifest names this job's id, or names none
    (older versions: the prefix owner's). Without an id of its own (a bare catalog) nothing is
    refused."""
    return job_id is None or manifest_job_id is None or manifest_job_id == job_id


def local_job_id(run_dir: str | Path, create: bool = False) -> str | None:
    """The job id in `run_dir/job_id` (written by ds3dd); with `create`, makes one if there is
    none (a plain torchrun run). Creation links a finished file, so two ranks racing agree."""
    path = Path(run_dir) / JOB_ID_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = ""
    if text or not create:
        return text or None
    tmp = path.with_name(f".{JOB_ID_FILE}.{os.getpid()}.tmp")
    tmp.write_text(new_job_id() + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def write_local_job_id(run_dir: str | Path, job_id: str) -> None:
    """ds3dd: the job's id in its directory, for its workers (never changed once written)."""
    path = Path(run_dir) / JOB_ID_FILE
    try:
        current = path.read_text().strip()
    except FileNotFoundError:
        current = ""
    if current == job_id:
        return
    if current:
        raise ForeignPrefixError(f"{path} names job id {current}, not {job_id}; the job "
                                 "directory belongs to another job")
    tmp = path.with_name(f".{JOB_ID_FILE}.{os.getpid()}.tmp")
    tmp.write_text(job_id + "\n")
    os.replace(tmp, path)
