"""Measuring each pipeline layer's forward and backward time (and memory) on a few steps.

`LayerProfiler` times the layers of this rank's stage on the steps it is asked to, and only on
those: its hooks are attached at `begin()` and removed at `end()`, so other steps run untouched.

    forward   a forward pre-hook on every layer marks where it starts; a layer's forward is the
              time to the next mark, the last one's to the end of DeepSpeed's ForwardPass
              instruction (so the head includes the loss)
    backward  a tensor hook on every layer's output marks when the gradient of that output is
              ready: the layer's backward runs from there to the next such mark (the first layer
              of the stage to the end of the BackwardPass instruction; the last from its start,
              so the head includes the loss's backward). With activation checkpointing the
              instruction's time (recomputation included) is shared out by forward time.
    memory    parameters of each layer on this rank, and the bytes a layer saves for backward
              per micro-batch (autograd's saved-tensor hooks, parameters and shared storage
              counted once), from the first micro-batch of each sampled step

Times come from `time.perf_counter` on CPU and CUDA events on GPU (resolved after the step, so
the device is not synchronised inside it). They are per micro-batch: the step's total divided by
the micro-batches, the median over the sampled steps.

The hooks cost time themselves (on CPU the hooked steps ran ~40% slower, not evenly over the
stages), so the profile is calibrated: a few unhooked steps time only the stage's ForwardPass and
BackwardPass instructions, and each stage's layer times are scaled so that they add up to what the
stage takes without hooks. The profile says how a stage's time divides among its layers; the
unhooked steps say how long the stage takes.

`PartitionTuner` decides when to profile (once, after a warm-up step, for
`partition_method = "measured"`; or on the daemon's `profile` command): CALIBRATION_STEPS
unhooked steps, then `partition_profile_steps` hooked ones. It gathers every rank's layers when
the window ends (one all_gather_object, at the same step on every rank), writes
`RUN_DIR/profile/layer-costs.json` (rank 0) and one `profile` report record per rank (the daemon
merges those, from every node), and proposes a partition (trainer/partition.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import JobConfig
from .kinds import RecordKind
from .partition import (
    CALIBRATION_STEPS,
    MemoryModel,
    Proposal,
    bytes_per_param,
    check_runnable,
    costs_json,
    layer_names,
    merge_profile_records,
    propose,
    write_layer_costs,
    write_partition_file,
)

Mark = Any  # float seconds (CPU) or torch.cuda.Event


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a: Mark, b: Mark) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def settle(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class LayerProfiler:
    """Per-layer timing of one pipeline stage (a DeepSpeed PipelineEngine's module)."""

    def __init__(self, engine: Any, device: torch.device, recompute: bool = False) -> None:
        self.engine = engine
        module = engine.module
        first = int(getattr(module, "_local_start", 0))
        self.layers: list[tuple[int, nn.Module]] = [
            (first + i, f) for i, f in enumerate(module.forward_funcs) if isinstance(f, nn.Module)]
        self.params = {idx: sum(p.numel() for p in layer.parameters())
                       for idx, layer in self.layers}
        self.clock = _Clock(device)
        self.recompute = recompute
        self.steps: list[dict[int, tuple[float, float]]] = []  # per sampled step, per micro-batch
        self.unhooked: list[float] = []  # the stage's forward + backward per micro-batch, no hooks
        self.activation_bytes: dict[int, int] = {}
        self.micro_batches = 0
        self._handles: list[Any] = []
        self._phase: str | None = None
        self._marks: list[tuple[int, Mark]] = []
        self._instr: list[tuple[str, Mark, list[tuple[int, Mark]], Mark]] = []
        self._saved_map: Any = None
        self._hooked = True
        self._measure_memory = False
        self._mem_ctx: Any = None
        self._mem_seen: set[int] = set()
        self._param_storage: set[int] = set()

    # -- window -------------------------------------------------------------------------------

    def begin(self, hooks: bool = True) -> None:
        """Attaches the hooks for one step; `hooks=False` times only the stage's forward and
        backward instructions (a calibration step)."""
        from deepspeed.runtime.pipe import schedule

        self._instr, self.micro_batches = [], 0
        self._hooked = hooks
        self._measure_memory = hooks
        if hooks:
            self._param_storage = {p.untyped_storage().data_ptr()
                                   for p in self.engine.module.parameters()}
            for idx, layer in self.layers:
                self._handles.append(layer.register_forward_pre_hook(self._pre_hook(idx)))
                self._handles.append(layer.register_forward_hook(self._post_hook(idx)))
        self._saved_map = self.engine.__dict__.get("_INSTRUCTION_MAP")
        table = dict(self.engine._INSTRUCTION_MAP)  # the StepTimer's wrappers, if any, stay inside
        table[schedule.ForwardPass] = self._wrap(table[schedule.ForwardPass], "forward")
        table[schedule.BackwardPass] = self._wrap(table[schedule.BackwardPass], "backward")
        self.engine._INSTRUCTION_MAP = table

    def end(self) -> None:
        """Removes the hooks and turns the step's marks into per-layer seconds."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._saved_map is None:
            self.engine.__dict__.pop("_INSTRUCTION_MAP", None)
        else:
            self.engine._INSTRUCTION_MAP = self._saved_map
        self._exit_memory()
        self.clock.settle()
        if not self._hooked:
            m = sum(1 for phase, *_ in self._instr if phase == "forward")
            total = sum(self.clock.seconds(start, stop) for _, start, _, stop in self._instr)
            self.unhooked.append(total / max(1, m))
            self._instr = []
            return
        fwd = {idx: 0.0 for idx, _ in self.layers}
        bwd = dict(fwd)
        backward_total = 0.0
        for phase, start, marks, stop in self._instr:
            if phase == "forward":
                self.micro_batches += 1
                for i, (idx, t) in enumerate(marks):
                    t0 = start if i == 0 else t
                    t1 = marks[i + 1][1] if i + 1 < len(marks) else stop
                    fwd[idx] += self.clock.seconds(t0, t1)
            elif self.recompute or not marks:
                backward_total += self.clock.seconds(start, stop)
            else:
                for i, (idx, t) in enumerate(marks):
                    t0 = start if i == 0 else t
                    t1 = marks[i + 1][1] if i + 1 < len(marks) else stop
                    bwd[idx] += self.clock.seconds(t0, t1)
        if backward_total:
            total_fwd = sum(fwd.values()) or 1.0
            for idx in bwd:
                bwd[idx] += backward_total * fwd[idx] / total_fwd
        m = max(1, self.micro_batches)
        self.steps.append({idx: (fwd[idx] / m, bwd[idx] / m) for idx in fwd})
        self._instr = []

    def calibration(self) -> dict[str, float]:
        """The stage's forward + backward per micro-batch as the hooked steps measured it (the
        sum of the layers' medians, what `summary` reports) and as the unhooked ones did, and
        their ratio (1 without unhooked steps)."""
        hooked = sum(statistics.median(s[idx][0] for s in self.steps)
                     + statistics.median(s[idx][1] for s in self.steps) for idx, _ in self.layers)
        plain = statistics.median(self.unhooked) if self.unhooked else hooked
        scale = plain / hooked if hooked > 0 and plain > 0 else 1.0
        return {"hooked_s": round(hooked, 6), "unhooked_s": round(plain, 6),
                "scale": round(scale, 4)}

    def summary(self) -> list[dict[str, Any]]:
        """One row per layer of this stage: the median over the sampled steps, scaled by the
        calibration."""
        scale = self.calibration()["scale"]
        out = []
        for idx, _ in self.layers:
            out.append({"layer": idx,
                        "forward_s": scale * statistics.median(s[idx][0] for s in self.steps),
                        "backward_s": scale * statistics.median(s[idx][1] for s in self.steps),
                        "params": self.params[idx],
                        "activation_bytes": self.activation_bytes.get(idx, 0)})
        return out

    def reset(self) -> None:
        self.steps, self.unhooked, self.activation_bytes = [], [], {}

    # -- hooks --------------------------------------------------------------------------------

    def _wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def run(engine: Any, **kwargs: Any) -> Any:
            self._phase, self._marks = phase, []
            start = self.clock.mark()
            try:
                return fn(engine, **kwargs)
            finally:
                stop = self.clock.mark()
                self._instr.append((phase, start, self._marks, stop))
                self._phase = None
                if phase == "forward":
                    self._measure_memory = False  # one micro-batch per step is enough
        return run

    def _pre_hook(self, idx: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._phase != "forward":
                return  # recomputation inside the backward pass
            self._marks.append((idx, self.clock.mark()))
            if self._measure_memory and torch.is_grad_enabled():
                self._enter_memory(idx)
        return hook

    def _post_hook(self, idx: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._phase != "forward":
                return
            self._exit_memory()
            if isinstance(output, torch.Tensor) and output.requires_grad and not self.recompute:
                output.register_hook(self._grad_hook(idx))
        return hook

    def _grad_hook(self, idx: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self._phase == "backward":
                self._marks.append((idx, self.clock.mark()))
        return hook

    def _enter_memory(self, idx: int) -> None:
        self._mem_seen = set()
        self.activation_bytes[idx] = 0  # the newest sampled step's first micro-batch

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._param_storage and ptr not in self._mem_seen:
                self._mem_seen.add(ptr)
                self.activation_bytes[idx] += storage.nbytes()
            return t

        self._mem_ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._mem_ctx.__enter__()

    def _exit_memory(self) -> None:
        if self._mem_ctx is not None:
            self._mem_ctx.__exit__(None, None, None)
            self._mem_ctx = None


class PartitionTuner:
    """When to profile, and what the profile proposes. Every rank holds one and calls
    `before_step` / `after_step` around every step; the window (a warm-up step, CALIBRATION_STEPS
    unhooked steps, then `partition_profile_steps` hooked ones) is counted in steps run, so all
    ranks end it at the same step, also after an in-process rollback."""

    def __init__(self, cfg: JobConfig, run_dir: Path, step_fn: Any, layout: Any, rank: int,
                 local_rank: int, parts: list[int], emit: Callable[..., None],
                 auto: bool) -> None:
        self.cfg, self.run_dir, self.rank, self.emit = cfg, run_dir, rank, emit
        self.local_rank = local_rank
        self.parts = list(parts)
        self.layout = layout
        self.micro_batches = step_fn.plan.gas
        self.enabled = bool(step_fn.pipelined and layout.pp_size > 1)
        self.profiler = LayerProfiler(step_fn.engine, step_fn.device,
                                      cfg.parallel.activation_checkpoint_interval > 0) \
            if self.enabled else None
        self.source: str | None = None  # "auto" | "request" while a window is open
        self._warmup = self._calibrate = 0
        self._sampling = False
        if auto and self.enabled:
            self.source, self._warmup, self._calibrate = "auto", 1, CALIBRATION_STEPS

    @property
    def active(self) -> bool:
        return self.source is not None

    def request(self) -> bool:
        """The daemon asked for a profile (`ds3dctl rebalance` without one): the next steps."""
        if not self.enabled:
            return False
        if self.source is None:
            self.source, self._warmup, self._calibrate = "request", 0, CALIBRATION_STEPS
        return True

    def before_step(self) -> None:
        if self.source is None or self._warmup > 0:
            return
        assert self.profiler is not None
        self.profiler.begin(hooks=self._calibrate == 0)
        self._sampling = True

    def after_step(self, step: int) -> tuple[str, Proposal | None] | None:
        """(source, proposal) at the step the window closes (collective), else None."""
        if self.source is None:
            return None
        if self._warmup > 0:
            self._warmup -= 1
            return None
        assert self.profiler is not None
        if self._sampling:
            self.profiler.end()
            self._sampling = False
        if self._calibrate > 0:
            self._calibrate -= 1
            return None
        if len(self.profiler.steps) < self.cfg.parallel.partition_profile_steps:
            return None
        source, self.source = self.source, None
        return source, self._gather(step, source)

    def decide(self, source: str, proposal: Proposal | None, step: int) -> list[int] | None:
        """What a closed window means. The automatic profile (partition_method = "measured")
        decides once: the boundaries to restart with when the measured split is faster by more
        than the threshold, else None (the current split is kept); either way the decision is
        persisted (partition.json), so later restarts neither profile nor decide again. A
        requested profile only reports (`ds3dctl rebalance` decides)."""
        if proposal is None or source != "auto" or step >= self.cfg.train.steps:
            return None
        apply = proposal.worth_it
        self.commit(proposal.proposed.boundaries if apply else self.parts, "measured", step,
                    "applied" if apply else "kept", proposal)
        return proposal.proposed.boundaries if apply else None

    def commit(self, boundaries: list[int], source: str, step: int, decision: str,
               proposal: Proposal | None = None) -> None:
        """Persists a partition for every later start: RUN_DIR/partition.json on every node
        (its first local rank), and a `repartition` record (rank 0)."""
        extra: dict[str, Any] = {"decision": decision, "step": step, "previous": self.parts}
        if proposal is not None:
            extra["predicted"] = proposal.as_dict()
        if self.local_rank == 0:
            write_partition_file(self.run_dir, self.cfg, boundaries, source, **extra)
        if self.rank == 0:
            fields: dict[str, Any] = {"decision": decision, "source": source,
                                      "current": self.parts, "proposed": list(boundaries)}
            if proposal is not None:
                fields.update(improvement=round(proposal.improvement, 4),
                              threshold=proposal.threshold,
                              current_step_s=proposal.current.step_s,
                              proposed_step_s=proposal.proposed.step_s,
                              current_bubble=round(proposal.current.bubble, 4),
                              proposed_bubble=round(proposal.proposed.bubble, 4))
            self.emit(RecordKind.REPARTITION, step=step, **fields)

    def from_command(self, payload: dict[str, Any] | None) -> tuple[list[int] | None, str]:
        """The boundaries of rank 0's `repartition` command, agreed by every rank (one
        broadcast); (None, why) when they cannot be used."""
        box: list[Any] = [payload.get("boundaries") if payload else None]
        dist.broadcast_object_list(box, src=0)
        parts = box[0]
        if not isinstance(parts, list) or not all(isinstance(b, int) for b in parts):
            return None, "the command carries no boundaries"
        problem = check_runnable(parts, self.cfg.model.n_layers, self.cfg.parallel.pp)
        if problem:
            return None, problem
        if parts == self.parts:
            return None, "the job already runs with these boundaries"
        return parts, ""

    def _gather(self, step: int, source: str) -> Proposal | None:
        assert self.profiler is not None
        p, t = self.cfg.parallel, self.cfg.train
        mem = MemoryModel(bytes_per_param(t.precision, p.zero_stage, self.layout.dp_size),
                          self._memory_limit())
        mine = {"kind": RecordKind.PROFILE, "step": step, "stage": self.layout.stage,
                "partition": self.parts, "micro_batches": self.micro_batches,
                "steps_sampled": len(self.profiler.steps), "source": source,
                "calibration": self.profiler.calibration(),
                "bytes_per_param": mem.bytes_per_param, "memory_limit_bytes": mem.limit_bytes,
                "layers": self.profiler.summary(), "time": round(time.time(), 3)}
        self.profiler.reset()
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        mine["round"] = everyone[0]["time"]
        for rec in everyone:
            rec["round"] = mine["round"]
        self.emit(**{k: v for k, v in mine.items() if k != "time"})
        merged = merge_profile_records(everyone, self.cfg.model.n_layers)
        if merged is None:
            return None
        proposal = propose(merged["layers"], self.parts, self.micro_batches,
                           p.partition_threshold, mem)
        if self.rank == 0:
            write_layer_costs(self.run_dir, costs_json(merged, proposal,
                                                       layer_names(self.cfg.model.n_layers)))
        return proposal

    def _memory_limit(self) -> float | None:
        gb = self.cfg.parallel.partition_memory_gb
        if gb is not None:
            return gb * 2**30
        if self.profiler is not None and self.profiler.clock.cuda:
            return 0.9 * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return None
