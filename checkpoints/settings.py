"""What a worker's checkpointing needs to know about its job, and nothing more.

`CheckpointManager` (engine_io.py) and `open_job_storage` take this instead of the trainer's
`JobConfig`, so storage knows no trainer: the trainer builds it from the job's configuration in
one place (`JobConfig.checkpoint_settings()`, trainer/config.py), where its fields are validated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CheckpointSettings:
    job: str
    """The job's name: its prefix in the store (`job_store_url`) and every manifest's `job`."""
    store: str | None
    """The durable tier, "file:///p" or "s3://b/p" (the job's prefix goes below it); None: the
    embedded default, a folder in the job's run directory."""
    local_dir: str | None
    """The node-local tier (DeepSpeed's save_dir); None: RUN_DIR/ckpt."""
    keep_last: int
    """Retention: the newest committed checkpoints kept (>= 1)."""
    keep_every: int
    """Retention: also kept, every Nth step (0 = none)."""
    cleanup_grace_s: float
    """Seconds before the leftovers of interrupted saves (uncommitted steps older than the
    newest commit, temporary files, unfinished multipart uploads) are removed: long enough that
    no uploader still at work (an outage, a slow store) loses its objects."""
    model_hash: str
    """The architecture's identity: a checkpoint restores only into the same hash."""
    zero_stage: int
    """DeepSpeed's ZeRO stage: which layout changes a checkpoint can be reshaped across, and how
    much of the optimizer state a rank holds (the pinned-memory estimate)."""
    keep_in_node_memory: bool | str = "auto"
    """Keep the newest save's host copy in node memory (/dev/shm), so that a restarted worker
    of this job restores from it (checkpoints/node_memory.py): "auto" where the node has room,
    else process memory as before; True: the same, but a start without room fails; False:
    process memory only."""
    memory_interval: int | str = 0
    """Steps between memory-only snapshots (snapshot.py: held in host and node memory, never
    written), taken between durable saves, or "auto" (the trainer's clock decides when); 0 =
    none. On, the snapshot engine keeps two arena slots (twice this rank's state in host
    memory / node memory)."""
    s3: Mapping[str, float | None] = field(default_factory=dict)
    """`[checkpoint.s3]` transfer settings for an s3:// store (s3_storage.options_from_settings);
    unset (None) fields fall back to ds3dd's DS3D_S3_* environment."""
