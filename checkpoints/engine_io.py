"""Saving a DeepSpeed engine into the node-local tier, and loading it back.

Every rank writes its own shards (DeepSpeed's sharded format). A checkpoint directory counts as
complete only once every rank has finished writing and rank 0 has written the completion marker
after a barrier; DeepSpeed's own `latest` file is not written (it is not atomic, and a pointer
must never be trusted over what is actually complete).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

TAG_RE = re.compile(r"^global_step(\d+)$")
COMPLETE_MARKER = "ds3d_complete.json"


def tag_for(step: int) -> str:
    return f"global_step{step}"


def save_engine(engine, ckpt_dir: str | Path, step: int, client_state: dict[str, Any]) -> float:
    """Writes the checkpoint of `step`; returns the seconds training was blocked."""
    t0 = time.perf_counter()
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()
    if dist.get_rank() == 0:
        marker = ckpt_dir / tag / COMPLETE_MARKER
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "world_size": dist.get_world_size(),
                                   "time": time.time()}))
        os.replace(tmp, marker)
    dist.barrier()
    return time.perf_counter() - t0


def complete_steps(ckpt_dir: str | Path) -> list[int]:
    """Steps with a complete local checkpoint, oldest first."""
    steps = []
    root = Path(ckpt_dir)
    if root.is_dir():
        for child in root.iterdir():
            m = TAG_RE.match(child.name)
            if m and (child / COMPLETE_MARKER).is_file():
                steps.append(int(m.group(1)))
    return sorted(steps)


def agree_on_step(local_choice: int, device: torch.device) -> int:
    """Rank 0's choice, broadcast so every rank loads the same checkpoint (-1 = none)."""
    t = torch.tensor([local_choice], dtype=torch.long, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


def load_engine(engine, ckpt_dir: str | Path, step: int) -> dict[str, Any]:
    """Loads `step` into the engine (weights, optimizer, scheduler); returns the client state."""
    path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag_for(step),
                                                load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    if path is None:
        from ds3d.trainer.errors import CheckpointError
        raise CheckpointError(f"DeepSpeed could not load checkpoint {tag_for(step)} from {ckpt_dir}")
    return client_state or {}
