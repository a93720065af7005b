"""Builds the DeepSpeed engine for a job: the DeepSpeed config, the optimizer, and either the
pipeline engine (any PP, ZeRO 0/1) or the plain engine (PP = 1 with ZeRO 2/3).

`TrainStep` hides the difference: one call runs one optimizer step over all micro-batches and
returns the same metrics from either engine.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import bf16_fastpath
from .config import JobConfig
from .data import BatchPlan
from .ds_config import build_deepspeed_config
from .layout import ParallelLayout
from .model import GPTSequential, build_pipeline
from .schedule import warmup_cosine
from .step_timing import StepTimer


def deepspeed_config(cfg: JobConfig, dp: int, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON for this job at data-parallel degree `dp`, from the job's own fields
    only (a user's `train.deepspeed_config` was translated into them when the job was built:
    trainer/ds_config_import.py), so that job.json, status and the engine agree."""
    return build_deepspeed_config(cfg, dp, load_universal)


def build_optimizer(model: torch.nn.Module, cfg: JobConfig,
                    device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay only on matrices (not biases, LayerNorm weights)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if name.endswith("weight") and p.dim() >= 2 else no_decay).append(p)
    t = cfg.train
    groups = [{"params": decay, "weight_decay": t.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, eps=t.eps, **extra)


@dataclass
class StepResult:
    loss: float
    grad_norm: float | None
    lr: float
    loss_scale: float | None
    # the optimizer did not apply this step's update: fp16 overflow, or a non-finite gradient
    # norm under BF16_Optimizer or ZeRO 1/2 (DeepSpeed discards the gradients)
    skipped: bool
    seconds: float


def defer_deepspeed_compile() -> None:
    """DeepSpeed's engine imports its Muon optimizer module, which decorates functions with
    torch.compile at import time; that imports inductor (~2 s of CPU per process, measured on
    every start and restart of every rank) for functions this trainer never calls. The
    decorator is made lazy: the same torch.compile, applied at a function's first call."""
    from deepspeed.runtime import compiler

    eager = getattr(compiler, "compile", None)
    if eager is None or getattr(eager, "deferred", False):
        return

    def compile_on_first_call(*args: Any, **kwargs: Any) -> Any:
        def decorate(fn: Any) -> Any:
            compiled = None

            @functools.wraps(fn)
            def run(*a: Any, **k: Any) -> Any:
                nonlocal compiled
                if compiled is None:
                    compiled = eager()(fn, *args, **kwargs)
                return compiled(*a, **k)
            return run
        return decorate

    compile_on_first_call.deferred = True  # type: ignore[attr-defined]
    compiler.compile = compile_on_first_call


class TrainStep:
    """One optimizer step of the job, over this rank's micro-batches."""

    def __init__(self, cfg: JobConfig, layout: ParallelLayout, device: torch.device,
                 load_universal: bool = False, parts: list[int] | None = None) -> None:
        import deepspeed

        defer_deepspeed_compile()
        bf16_fastpath.install()
        self.cfg, self.layout, self.device = cfg, layout, device
        self.pipelined = cfg.parallel.zero_stage < 2
        if self.pipelined:
            model: torch.nn.Module = build_pipeline(cfg, layout.topology, layout.tp, device,
                                                    parts)
        else:
            with torch.device(device):
                model = GPTSequential(cfg, layout.tp)
        if cfg.train.precision == "bf16" and not self.pipelined:
            model = model.to(torch.bfloat16)
        optimizer = build_optimizer(model, cfg, device)
        t = cfg.train
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer,
            config=deepspeed_config(cfg, layout.dp_size, load_universal),
            lr_scheduler=warmup_cosine(t.warmup_steps, t.steps, t.min_lr_ratio),
            mpu=layout.grid if not self.pipelined else None)
        if cfg.train.compile:
            self.engine.compile()
        self.plan = BatchPlan(cfg, layout.dp_size, layout.dp_rank)
        self.timer = StepTimer(self.engine, device, cfg.train.timing_interval)
        self.last_split: dict[str, Any] | None = None  # of the last sampled step
        self._counters_before: tuple[int, int, int] | None = None  # of the last step

    def _tensors(self, batch: tuple[Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (torch.from_numpy(a) for a in batch)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def run(self, step: int) -> StepResult:
        """Trains on the batch of optimizer step `step` (0-based)."""
        engine = self.engine
        skipped_before = engine.skipped_steps
        self._counters_before = (engine.global_steps, engine.global_samples, skipped_before)
        lr = float(engine.optimizer.param_groups[0]["lr"])  # the LR this step trains with
        timer = self.timer
        timer.begin(step + 1)
        t0 = time.perf_counter()
        if self.pipelined:
            batches = (self._tensors(b) for b in self.plan.step_iterator(step))
            loss = engine.train_batch(data_iter=batches).item()
        else:
            total = torch.zeros((), device=self.device)
            for b in self.plan.step_iterator(step):
                with timer.part("data"):
                    x, y = self._tensors(b)
                with timer.part("forward"):
                    micro_loss = engine(x, y)
                with timer.part("backward"):
                    engine.backward(micro_loss)
                with timer.part("optimizer"):
                    engine.step()
                total += micro_loss.detach().float()
            total /= self.plan.gas
            dist.all_reduce(total, group=self.layout.grid.get_data_parallel_group())
            loss = (total / self.layout.dp_size).item()
        seconds = time.perf_counter() - t0
        self.last_split = timer.end(seconds, self.layout.pp_size, self.plan.gas)
        norm = engine.get_global_grad_norm()
        return StepResult(
            loss=loss,
            grad_norm=float(norm) if norm is not None else None,
            lr=lr,
            loss_scale=_loss_scale(engine) if self.cfg.train.precision == "fp16" else None,
            skipped=engine.skipped_steps > skipped_before,
            seconds=seconds,
        )

    def forget_skipped_step(self) -> None:
        """Takes back the last step, whose update the optimizer skipped, as if it never ran.

        DeepSpeed (0.19, `DeepSpeedEngine._take_model_step`) on a skipped update leaves the
        weights and the optimizer's moments and step counts as they were, clears the
        gradients and does not step the LR scheduler, but still advances `global_steps`,
        `global_samples` and `skipped_steps`: those three are put back, so that the engine
        equals the one a rollback to the step before would give (a checkpoint restores the
        three). `micro_steps` is left as is: a rollback does not restore it either, and a
        whole step's micro-batches keep it on an accumulation boundary."""
        engine, before = self.engine, self._counters_before
        if before is None or engine.was_step_applied() or engine.skipped_steps != before[2] + 1:
            raise RuntimeError("forget_skipped_step: the last step's update was applied (or "
                               "no step ran); only a rollback can take it back")
        engine.global_steps, engine.global_samples, engine.skipped_steps = before
        self._counters_before = None

    @property
    def tokens_per_step(self) -> int:
        return self.plan.global_batch * self.cfg.model.seq_len


def _loss_scale(engine) -> float | None:
    opt = engine.optimizer
    for attr in ("cur_scale", "loss_scale"):
        value = getattr(opt, attr, None)
        if value is not None:
            return float(value)
    return None
