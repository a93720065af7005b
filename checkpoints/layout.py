"""Where checkpoint objects and local markers live: the one place that spells out the layout.

The trainer, the daemon and the uploader all depend on these names, so they are fixed here and
nowhere else. Keys are relative to a store prefix P (the job's `checkpoint.store` URL):

    P/ckpt/step-00000100/files/<relative path>     every file of the checkpoint, sub-folders kept
                                                   (DeepSpeed writes `global_step100/...`)
    P/ckpt/step-00000100/parts/rank-00003.json     rank 3's part manifest, written after its files
    P/ckpt/step-00000100/MANIFEST.json             written LAST by one committer once all
                                                   `world_size` parts exist; merges the parts
    P/latest                                       convenience pointer ("step-00000100"); never
                                                   trusted over manifests
    P/JOB-ID                                       the owner of the prefix: {"job_id", "job",
                                                   "created"}, created once (conditional put) by
                                                   the first job that writes there (identity.py)

A checkpoint exists only when its MANIFEST exists and verifies. The local tier L (the job's
`checkpoint.local_dir`) holds DeepSpeed's own tree (`L/global_step100/...`, the same relative
paths as under `files/`) and ds3d's bookkeeping under `L/.ds3d/`:

    L/.ds3d/step-00000100/rank-00003.json          upload state of rank 3's files (pending, failed,
                                                   uploaded, committed) with the last error
    L/.ds3d/step-00000100/MANIFEST.json            copy of the committed manifest, once known
    L/.ds3d/step-00000100/local-rank-00003.json    rank 3's files verified on this disk (sizes,
                                                   sha256, the save's metadata): the step is
                                                   local-complete where every rank's record is
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

CKPT_ROOT = "ckpt/"
LATEST_KEY = "latest"
JOB_ID_KEY = "JOB-ID"
LOCAL_STATE_DIR = ".ds3d"
MANIFEST_NAME = "MANIFEST.json"

_STEP_RE = re.compile(r"^ckpt/step-(\d{8,})/")
_PART_RE = re.compile(r"/parts/rank-(\d{5,})\.json$")


def step_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def step_prefix(step: int) -> str:
    return f"{CKPT_ROOT}{step_name(step)}/"


def files_prefix(step: int) -> str:
    return f"{step_prefix(step)}files/"


def file_key(step: int, rel_path: str) -> str:
    return files_prefix(step) + check_rel_path(rel_path)


def parts_prefix(step: int) -> str:
    return f"{step_prefix(step)}parts/"


def part_key(step: int, rank: int) -> str:
    return f"{parts_prefix(step)}rank-{rank:05d}.json"


def manifest_key(step: int) -> str:
    return step_prefix(step) + MANIFEST_NAME


def step_of_key(key: str) -> int | None:
    """The step a key belongs to, or None for keys outside `ckpt/step-N/`."""
    m = _STEP_RE.match(key)
    return int(m.group(1)) if m else None


def rank_of_part_key(key: str) -> int | None:
    m = _PART_RE.search(key)
    return int(m.group(1)) if m else None


def check_rel_path(rel_path: str) -> str:
    """A checkpoint-relative path in POSIX form; refuses anything that could escape the folder."""
    p = PurePosixPath(rel_path.replace("\\", "/"))
    if p.is_absolute() or not p.parts or any(part in ("..", ".", "") for part in p.parts):
        raise ValueError(f"checkpoint file path {rel_path!r} must be relative, without '..'")
    if p.parts[0] == LOCAL_STATE_DIR:
        raise ValueError(f"checkpoint file path {rel_path!r} is inside ds3d's state folder")
    return p.as_posix()


def default_tag(step: int) -> str:
    """DeepSpeed's default tag for a step (its checkpoint sub-folder)."""
    return f"global_step{step}"


def local_state_dir(local_dir: str | Path, step: int) -> Path:
    return Path(local_dir) / LOCAL_STATE_DIR / step_name(step)


def local_rank_marker(local_dir: str | Path, step: int, rank: int) -> Path:
    return local_state_dir(local_dir, step) / f"rank-{rank:05d}.json"


def local_complete_path(local_dir: str | Path, step: int, rank: int) -> Path:
    """Rank `rank`'s record that its files of `step` are on this disk and verified."""
    return local_state_dir(local_dir, step) / f"local-rank-{rank:05d}.json"


def local_manifest_path(local_dir: str | Path, step: int) -> Path:
    return local_state_dir(local_dir, step) / MANIFEST_NAME
