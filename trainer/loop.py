"""The step loop of one worker: restore, then step / report / checkpoint / obey commands.

All ranks take every decision together. Once per step one small all-reduce (MAX) carries
[command id, command action, non-finite flag]: rank 0 contributes the daemon's newest command,
every rank contributes whether its loss or gradient norm was NaN/Inf. So a command or a fault is
acted on by every rank at the same step, and no rank decides alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from ds3d.checkpoints import engine_io

from .config import JobConfig
from .engine import StepResult, TrainStep
from .layout import ParallelLayout, ProcessEnv
from .report import Reporter

log = structlog.get_logger()

ACTIONS = {"save": 1, "pause": 2, "stop": 3, "stop_now": 4}
ACTION_NAMES = {v: k for k, v in ACTIONS.items()}


class CommandInbox:
    """Reads the daemon's newest command (control/command.json, replaced atomically)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "control" / "command.json"
        self.seen = 0

    def poll(self) -> tuple[int, int]:
        try:
            cmd = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return 0, 0
        cid, action = int(cmd.get("id", 0)), ACTIONS.get(cmd.get("action", ""), 0)
        return (cid, action) if cid > self.seen and action else (0, 0)


class Trainer:
    def __init__(self, cfg: JobConfig, run_dir: Path, env: ProcessEnv, layout: ParallelLayout,
                 device: torch.device, stop_at_step: int | None = None) -> None:
        self.cfg, self.run_dir, self.env, self.layout, self.device = cfg, run_dir, env, layout, device
        self.ckpt_dir = Path(cfg.checkpoint.local_dir or run_dir / "ckpt")
        self.reporter = Reporter(run_dir, env.rank, env.restart_count)
        self.inbox = CommandInbox(run_dir)
        self.reporter.emit("heartbeat", step=0, phase="init")
        self.step_fn = TrainStep(cfg, layout, device)
        self.step = 0
        self.tokens_seen = 0
        self.saved_step = -1
        self.stop_at_step = stop_at_step

    # -- checkpoints --------------------------------------------------------------------------

    def client_state(self) -> dict[str, Any]:
        from .checkpoint_info import universal_checkpoint_info

        return {
            "iteration": self.step,
            "ds3d": {"step": self.step, "tokens_seen": self.tokens_seen,
                     "skip_batches": [list(w) for w in self.cfg.data.skip_batches],
                     "model_hash": self.cfg.model_hash(), "layout": self.layout.describe()},
            "universal_checkpoint_info": universal_checkpoint_info(self.cfg),
        }

    def save(self) -> None:
        if self.step == self.saved_step:
            return
        self.reporter.emit("heartbeat", step=self.step, phase="save")
        blocked = engine_io.save_engine(self.step_fn.engine, self.ckpt_dir, self.step,
                                        self.client_state())
        self.reporter.emit("checkpoint", step=self.step, phase="saved", blocked_s=round(blocked, 4),
                           path=str(self.ckpt_dir / engine_io.tag_for(self.step)))
        self.saved_step = self.step
        log.info("checkpoint saved", step=self.step, blocked_s=round(blocked, 3))

    def restore(self) -> None:
        if not self.cfg.checkpoint.load:
            return
        steps = engine_io.complete_steps(self.ckpt_dir) if self.env.rank == 0 else []
        step = engine_io.agree_on_step(steps[-1] if steps else -1, self.device)
        if step < 0:
            return
        self.reporter.emit("heartbeat", step=step, phase="load")
        state = engine_io.load_engine(self.step_fn.engine, self.ckpt_dir, step)
        ds3d = state.get("ds3d", {})
        self.step = self.saved_step = int(ds3d.get("step", step))
        self.tokens_seen = int(ds3d.get("tokens_seen", self.step * self.step_fn.tokens_per_step))
        log.info("resumed from checkpoint", step=self.step)

    # -- the loop -----------------------------------------------------------------------------

    def _agree(self, result: StepResult | None) -> tuple[int, int, bool]:
        cid, action = self.inbox.poll() if self.env.rank == 0 else (0, 0)
        bad = result is not None and not (math.isfinite(result.loss) and (
            result.grad_norm is None or math.isfinite(result.grad_norm)))
        flags = torch.tensor([cid, action, int(bad)], dtype=torch.long, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return int(flags[0]), int(flags[1]), bool(flags[2])

    def _report_step(self, r: StepResult) -> None:
        tps = self.step_fn.tokens_per_step / r.seconds if r.seconds > 0 else 0.0
        if self.env.rank == 0:
            self.reporter.emit("step", step=self.step, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr,
                               loss_scale=r.loss_scale, tokens_per_s=round(tps, 1),
                               step_time_s=round(r.seconds, 5), skipped=r.skipped,
                               tokens_seen=self.tokens_seen)
            log.info("step", step=self.step, loss=round(r.loss, 6), lr=r.lr,
                     grad_norm=None if r.grad_norm is None else round(r.grad_norm, 4),
                     tokens_per_s=round(tps, 1))
        self.reporter.emit("heartbeat", step=self.step, phase="train", step_time_s=round(r.seconds, 5))

    def _obey(self, cid: int, action: int) -> str | None:
        """Acts on a command; returns the reason to stop, if any."""
        name = ACTION_NAMES[action]
        self.inbox.seen = cid
        if name != "stop_now":
            self.save()
        self.reporter.emit("command", id=cid, action=name, status="done", step=self.step)
        return {"pause": "paused", "stop": "stopped", "stop_now": "stopped"}.get(name)

    def run(self) -> str:
        """Trains to the configured step count; returns why it ended."""
        self.restore()
        steps, interval = self.cfg.train.steps, self.cfg.checkpoint.interval
        first = self.step
        self.reporter.emit("start", step=first, device=str(self.device), **self.layout.describe())
        reason = "completed"
        cid, action, _ = self._agree(None)
        while True:
            if action:
                stop = self._obey(cid, action)
                if stop:
                    reason = stop
                    break
            if self.step >= steps:
                break
            if self.stop_at_step is not None and self.step >= self.stop_at_step:
                self.save()
                reason = "paused"
                break
            result = self.step_fn.run(self.step)
            self.step += 1
            self.tokens_seen += self.step_fn.tokens_per_step
            self._report_step(result)
            cid, action, nonfinite = self._agree(result)
            if nonfinite:
                self.reporter.emit("fault", cause="nan", step=self.step,
                                   detail=f"loss={result.loss} grad_norm={result.grad_norm}")
            if interval and self.step % interval == 0 and self.step < steps:
                self.save()
        if reason == "completed" and self.step > first:
            self.save()
        self.reporter.emit("done", step=self.step, reason=reason)
        return reason

    def close(self) -> None:
        self.reporter.close()
