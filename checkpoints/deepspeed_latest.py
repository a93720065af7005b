"""DeepSpeed's `latest` file, so that DeepSpeed's own tools find ds3d's checkpoints without a tag.

DeepSpeed's loaders and `zero_to_fp32` read `<dir>/latest` (the tag, e.g. "global_step100") when
no tag is given. ds3d saves with `save_latest=False` and never reads `latest` itself (it trusts
only manifests), because DeepSpeed writes it before the checkpoint is durable. Here it is written
where a tool would look, and only for committed checkpoints:

  * in the local tier, `L/latest` names the newest committed tag present there (rewritten after
    each commit, and after a delete or rollback removed the tag it named);
  * in the store, `P/ckpt/step-N/files/latest` names step N's tag, so that a copy of
    `files/` (e.g. `aws s3 sync`) is a complete DeepSpeed checkpoint folder. It is written just
    before the MANIFEST and is not part of it: it holds nothing a restore needs.

Both are written atomically (a temporary name, then a rename: atomic_file.py; one small PUT in
a store). The local one is refreshed under an exclusive lock on `L/.latest.lock`: a committing
upload thread and a rollback's delete (in one process or in several ranks of a node) each decide
and write as one step, so the last refresh always sees every delete before it and `latest` never
names a removed tag.
"""

from __future__ import annotations

import fcntl
import re
from pathlib import Path

from . import layout
from .atomic_file import replace_file
from .storage import Storage

LATEST = "latest"
_STEP_DIR_RE = re.compile(r"^step-(\d{8,})$")


def store_latest_key(step: int) -> str:
    return layout.file_key(step, LATEST)


def write_store_latest(storage: Storage, step: int, tag: str) -> None:
    storage.put_bytes(store_latest_key(step), tag.encode())


def refresh_local_latest(local_dir: str | Path) -> str | None:
    """Points `L/latest` at the newest committed tag whose folder is in the local tier (removes
    it when there is none); returns the tag written."""
    root = Path(local_dir)
    if not root.is_dir():
        return None
    with open(root / f".{LATEST}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _refresh_locked(root)


def _refresh_locked(root: Path) -> str | None:
    from .manifest import Manifest

    state = root / layout.LOCAL_STATE_DIR
    steps = sorted((int(m.group(1)) for p in state.glob(f"step-*/{layout.MANIFEST_NAME}")
                    if (m := _STEP_DIR_RE.match(p.parent.name))), reverse=True)
    target = None
    for step in steps:
        try:
            tag = Manifest.from_json(layout.local_manifest_path(root, step).read_bytes()).tag
        except (OSError, ValueError):
            continue
        if (root / tag).is_dir():
            target = tag
            break
    path = root / LATEST
    if target is None:
        path.unlink(missing_ok=True)
        return None
    try:
        if path.read_text() == target:
            return target
    except OSError:
        pass
    replace_file(path, target)
    return target
