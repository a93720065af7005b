"""Restoring a checkpoint into a different (TP, PP, DP) layout through DeepSpeed's universal
checkpoint.

`ds_to_universal` turns a sharded checkpoint into one file per parameter (fp32 weights and Adam
moments, TP shards joined by the patterns ds3d saved as `universal_checkpoint_info`); any layout
then loads it with `"checkpoint": {"load_universal": true}`. It runs offline on CPU in a child
process (it uses a process pool, and its failure must not take the worker down with a traceback
the user cannot act on).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import CheckpointError, RestoreError
from .manifest import Layout

UNIVERSAL_SUFFIX = "_universal"

# what the converter prints when the moment failed it, not the checkpoint: memory, the disk
_MOMENT_MARKERS = ("memoryerror", "cannot allocate memory", "no space left on device",
                   "input/output error", "disk quota exceeded")


class ConversionError(RestoreError):
    """`ds_to_universal` failed on a checkpoint whose files verified. `checkpoint_at_fault`:
    the converter's own error (a pattern or shape it cannot join), which every later try meets
    again; False when a signal killed it (the kernel's OOM killer) or it ran out of memory or
    disk, which a later try may not. Retryable either way: the daemon pauses the job when the
    same checkpoint failed in two worker groups (daemon/load_failures.py)."""

    def __init__(self, message: str, checkpoint_at_fault: bool, reason: str = "") -> None:
        super().__init__(message)
        self.checkpoint_at_fault = checkpoint_at_fault
        self.reason = reason or message  # the converter's last line: its exception


def needs_reshape(saved: Layout, tp: int, pp: int, dp: int) -> bool:
    return (saved.tp, saved.pp, saved.dp) != (tp, pp, dp)


def check_reshapable(saved: Layout, tp: int, pp: int, dp: int, zero_stage: int) -> None:
    """Refuses what DeepSpeed's universal checkpoint cannot do, before any work is spent."""
    if zero_stage >= 2 and pp > 1:
        raise CheckpointError("a ZeRO-2/3 job cannot use pipeline parallelism; restore with pp=1")
    if zero_stage == 3 and saved.tp > 1:
        raise CheckpointError(f"a ZeRO-3 checkpoint saved with tp={saved.tp} cannot be reshaped by "
                              "DeepSpeed's universal checkpoint; restore with the same layout")


def convert_to_universal(ckpt_dir: str | Path, tag: str, workers: int = 2) -> str:
    """Converts `ckpt_dir/tag` into `ckpt_dir/tag_universal` (once; reused if already there).
    Returns the universal tag."""
    ckpt_dir = Path(ckpt_dir)
    out_tag = tag + UNIVERSAL_SUFFIX
    out = ckpt_dir / out_tag
    done = out / ".ds3d_converted"
    if done.is_file():
        return out_tag
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", str(ckpt_dir / tag), "--output_folder", str(out),
           "--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)  # a half-written copy of the whole state
        said = (proc.stdout + proc.stderr).strip()
        tail = "\n".join(said.splitlines()[-15:])
        if said:
            last = said.splitlines()[-1].strip()
        elif proc.returncode < 0:
            last = f"killed by signal {-proc.returncode}"
        else:
            last = f"exit {proc.returncode}"
        raise ConversionError(f"converting {tag} to a universal checkpoint failed "
                              f"(exit {proc.returncode}); DeepSpeed said:\n{tail}",
                              converter_at_fault(proc.returncode, said), last)
    done.write_text("ok\n")
    return out_tag


def converter_at_fault(returncode: int, output: str) -> bool:
    """Whether `ds_to_universal` failing with `returncode` and `output` refused the checkpoint
    itself: not when a signal killed it or it ran out of memory or disk."""
    return returncode > 0 and not any(m in output.lower() for m in _MOMENT_MARKERS)
