"""TensorBoard event files of a job, written by rank 0 through torch's maintained writer.

Files go to RUN_DIR/tensorboard (`ds3dctl logs JOB --tensorboard` prints the path); each
restart of the worker group adds a file to the same folder, which TensorBoard reads as one run.
MFU is logged where the accelerator's dense bf16 peak is known (datasheet values, or
DS3D_PEAK_TFLOPS for other hardware).

Tags: train/{loss,lr,grad_norm,loss_scale (fp16)}, perf/{tokens_per_s,step_time_s,mfu}, on
sampled steps time/<part> and perf/{bubble,bubble_theoretical,reduce_to_forward},
checkpoint/blocked_s, faults/restarts (the agent's restart count), faults/rollback_<cause>
(in-process rollbacks), faults/skipped_update_nan (a NaN step whose skipped update was undone in
place) and restarts/<cause> (why this start is not the job's first; see
`restart_cause`).

Scalars are written by a thread of their own: building an event costs ~40 us of Python per
scalar, ~0.3 ms a step on the training thread between the step's end and the next one's launch,
where the GPU waits. A worker that dies loses at most the scalars since its last ~10 s (as
SummaryWriter's own buffering did already).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from .config import JobConfig
from .kinds import RecordKind
from .report import read_rank_records

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0,
                    "L40S": 362.0, "B200": 2250.0}


def device_peak_tflops(device: torch.device) -> float | None:
    if os.environ.get("DS3D_PEAK_TFLOPS"):
        return float(os.environ["DS3D_PEAK_TFLOPS"])
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def flops_per_step(cfg: JobConfig, global_batch: int) -> float:
    """6 N T for the dense matmuls plus 12 L d s T for attention's score and value products."""
    m = cfg.model
    tokens = global_batch * m.seq_len
    return 6 * m.n_params() * tokens + 12 * m.n_layers * m.d_model * m.seq_len * tokens


def restart_cause(records: list[dict[str, Any]], pid: int, world_size: int,
                  restart: int) -> tuple[str, int] | None:
    """(cause, resumed step) of this start of rank 0, from rank 0's own report file: the records
    of this process (`pid`) and of the run before it. None for the job's first start (or when
    rank 0 ran on another node before: its records are there). Causes: "rollback" (the daemon
    asked for a checkpoint step), "after_<reason>" (the previous workers ended cleanly: paused,
    repartition, restart, ...), "worker_exit" / "node_lost" / "node_joined" (the elastic agent
    restarted the group; the world size says which), "unclean_exit" (the daemon relaunched
    after killing or losing the workers: hang, crash, OOM; `ds3dctl events` names the fault)."""
    mine = [r for r in records if r.get("pid") == pid]
    before = [r for r in records if r.get("pid") != pid]
    if not before:
        return None
    prev = [r for r in before if r.get("pid") == before[-1].get("pid")]
    step = next((int(r.get("step", 0)) for r in mine
                 if r.get("kind") == RecordKind.CHECKPOINT and r.get("phase") == "loaded"), 0)
    if any(r.get("kind") == RecordKind.CHECKPOINT and r.get("phase") == "rolled_back"
           for r in mine):
        return "rollback", step
    done = [r for r in prev if r.get("kind") == RecordKind.DONE]
    if done:
        return f"after_{done[-1].get('reason') or 'done'}", step
    if restart > 0:
        worlds = [int(r.get("world_size", 0)) for r in prev if r.get("kind") == RecordKind.START]
        old = worlds[-1] if worlds else world_size
        return ("node_lost" if old > world_size else "node_joined" if old < world_size
                else "worker_exit"), step
    return "unclean_exit", step


class DiskFullTolerantWriter:
    """A SummaryWriter that a full disk cannot stop training with. torch's writer raises the
    ENOSPC of its background thread in the training thread, on every later call, for good; so
    on a full disk this drops the writer (its scalars until then are lost), and makes a new one
    (a new event file in the same folder, read as the same run) at most every 10 s once a
    call comes. Other errors are raised as before."""

    RETRY_S = 10.0

    def __init__(self, make: Any) -> None:
        self._make = make
        self._writer: Any = make()
        self._broken_at = 0.0

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            import time

            from ds3d.checkpoints.disk_space import is_disk_full

            try:
                if self._writer is None:
                    if time.monotonic() - self._broken_at < self.RETRY_S:
                        return None
                    self._writer = self._make()
                return getattr(self._writer, name)(*args, **kwargs)
            except OSError as e:
                if not is_disk_full(e):
                    raise
                broken, self._writer, self._broken_at = self._writer, None, time.monotonic()
                try:
                    if broken is not None:
                        broken.close()  # ends its thread; its last flush fails too
                except OSError:
                    pass
                return None
        return call


class TensorBoardLog:
    def __init__(self, cfg: JobConfig, run_dir: Path, device: torch.device, world_size: int,
                 global_batch: int, restart: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(run_dir) / "tensorboard"
        self.writer: Any = DiskFullTolerantWriter(
            lambda: SummaryWriter(log_dir=str(self.path), flush_secs=10))
        self._scalars: queue.SimpleQueue[tuple[str, float, int] | None] = queue.SimpleQueue()
        self._failed = False
        self._thread = threading.Thread(target=self._write_scalars, name="ds3d-tensorboard",
                                        daemon=True)
        self._thread.start()
        peak = device_peak_tflops(device)
        self.flops = flops_per_step(cfg, global_batch)
        self.peak_total = peak * 1e12 * world_size if peak else None
        self.restart = restart
        records = read_rank_records(run_dir, 0)
        cause = restart_cause(records, os.getpid(), world_size, restart)
        if cause is not None:  # a marker at the step training resumed from
            self.scalar(f"restarts/{cause[0]}", 1, cause[1])

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None,
             loss_scale: float | None, tokens_per_s: float, step_time_s: float) -> float | None:
        """Logs one step; returns its MFU where the peak is known."""
        w = self.scalar
        w("train/loss", loss, step)
        w("train/lr", lr, step)
        if grad_norm is not None:
            w("train/grad_norm", grad_norm, step)
        if loss_scale is not None:
            w("train/loss_scale", loss_scale, step)
        w("perf/tokens_per_s", tokens_per_s, step)
        w("perf/step_time_s", step_time_s, step)
        if self.peak_total and step_time_s > 0:
            mfu = self.flops / step_time_s / self.peak_total
            w("perf/mfu", mfu, step)
            return mfu
        return None

    def split(self, step: int, split: dict) -> None:
        """Rank 0's step-time split of a sampled step (its stage's view; every rank's is in the
        reports and, per stage, in Prometheus)."""
        for key, value in split.items():
            if key in ("bubble", "bubble_theoretical", "reduce_to_forward"):
                self.scalar(f"perf/{key}", value, step)
            else:
                self.scalar(f"time/{key}", value, step)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._scalars.put((tag, value, step))

    def _write_scalars(self) -> None:
        while (item := self._scalars.get()) is not None:
            try:
                self.writer.add_scalar(*item)
            except Exception as e:  # noqa: BLE001 - TensorBoard must not stop training
                if not self._failed:
                    print(f"ds3d: TensorBoard scalars are not written to {self.path}: {e!r}",
                          file=sys.stderr, flush=True)
                self._failed = True

    def close(self) -> None:
        """Writes the scalars still queued, then closes the event file."""
        self._scalars.put(None)
        self._thread.join(timeout=30)
        self.writer.close()
