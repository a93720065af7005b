"""DeepSpeed's recovery scripts in the checkpoint folder: copied once, never at the cost of a save.

`DeepSpeedEngine.save_checkpoint` copies `zero_to_fp32.py` and its siblings into the checkpoint
folder on rank 0 at every save, from the training thread, outside the checkpoint engine, with a
plain truncating copy. On a full disk that copy raised ENOSPC out of the save and ended the
worker (its agent restarted the group: the state-dir disk-full drill saw restarts == 1). ds3d
needs none of them (trainer/export.py has its own path), so `copy_recovery_scripts_once` makes
the engine copy them at the first save that has room for them, and a copy that a full disk
refuses is skipped with a warning (a partly written script is rewritten by the next save's
copy) instead of failing the save.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import structlog

from .disk_space import is_disk_full

log = structlog.get_logger("ds3d.checkpoints")


class _CopyOnce:
    """Stands in for the engine's bound `_copy_recovery_script(save_path)`."""

    def __init__(self, copy: Callable[[str], None]) -> None:
        self.copy = copy
        self.done = False

    def __call__(self, save_path: str) -> None:
        if self.done:
            return
        try:
            self.copy(save_path)
        except OSError as e:
            if not is_disk_full(e):
                raise
            log.warning("recovery_scripts_skipped", path=save_path, error=str(e),
                        detail="no room for DeepSpeed's recovery scripts (zero_to_fp32.py...); "
                               "the save goes on, the next one copies them")
            return
        self.done = True


def copy_recovery_scripts_once(engine: Any) -> None:
    """Wraps `engine`'s recovery-script copy (once; a DeepSpeed without one is left as it is)."""
    copy = getattr(engine, "_copy_recovery_script", None)
    if copy is not None and not isinstance(copy, _CopyOnce):
        engine._copy_recovery_script = _CopyOnce(copy)


@contextmanager
def recovery_scripts_skipped(engine: Any) -> Iterator[None]:
    """While open, `engine`'s saves copy no recovery script: a memory-only snapshot
    (snapshot.py) has no folder to copy them into."""
    copy = getattr(engine, "_copy_recovery_script", None)
    if copy is None:
        yield
        return
    engine._copy_recovery_script = _skip
    try:
        yield
    finally:
        engine._copy_recovery_script = copy


def _skip(save_path: str) -> None:
    pass
