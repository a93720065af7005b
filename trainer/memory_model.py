"""Peak memory of one rank of a job, predicted before anything is launched, and the smallest
layout that fits a node: what `ds3dctl start` refuses with and `ds3dctl check` prints.

No torch import: the daemon and ds3dctl use it at every start and check.

What a rank holds (bytes per parameter of its shard P = stage parameters / TP), as DeepSpeed
0.19's optimizers store it, checked on an H200 (docs/memory-model.md):

* bf16/fp16, ZeRO 0/1 (BF16_Optimizer, the pipeline engine): bf16 weights 2 + fp32 gradient
  accumulator 4 (full) + fp32 master weights 4 and Adam's moments 8, divided by DP under ZeRO-1;
* bf16/fp16, ZeRO-2 (plain engine): bf16 weights 2 + (master 4 + moments 8) / DP;
  ZeRO-3: (2 + 12) / DP plus the gathered weights of the block being computed;
* fp32: weights 4, gradients 4, moments 8 (/ DP under ZeRO >= 1);
* during backward and the optimizer step: 4 more (bf16 gradients as the backward produces them,
  and the step's working memory; measured 4.0 at 1.4B and 2.8B parameters).

Activations per micro-batch and block, elements of [micro-batch, seq, d_model] (bf16: 2 bytes
each, fp32: 4), with flash attention (no [s, s] scores) and TP degree t:
  4 (LayerNorm inputs and outputs, replicated) + (5 + 2 f / d) / t (q, k, v, attention output,
  its copy for the projection, the MLP's two [.., f] tensors), i.e. 34 bytes x s x b x d at
  f = 4d, t = 1 (Megatron's figure without dropout masks). Activation checkpointing every k
  blocks keeps each segment's input plus one segment recomputed at a time. Under 1F1B a stage
  i of PP holds up to min(PP - i, micro-batches per step) micro-batches in flight. The last
  stage keeps its logits [b, s, V/t] (the pipeline engine holds the outputs) and the loss's
  gradient of the same size (TP > 1: fp32 logits and softmax, 8 bytes each).

Peak = static + max(activations, backward transient). The fit check adds the allocator's
headroom (reserved over allocated was 1.10-1.27 on the H200) and the CUDA context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .config import JobConfig

GiB = 1 << 30
ALLOCATOR_HEADROOM = 1.15  # reserved / allocated peak seen on the H200 (1.10-1.27), typical
CUDA_CONTEXT_BYTES = 2 * GiB  # context, cuBLAS / cuDNN workspaces, NCCL buffers
# a worker process's own host memory besides the state (python, torch, DeepSpeed; the CUDA
# runtime on GPU): 8 CPU ranks of the tiny model took 3.5 GB in all (FIELD-NOTES); a CUDA
# process's runtime and libraries take ~2 GB (assumed, not measured here)
HOST_PROCESS_BYTES = {"cpu": GiB // 2, "cuda": 2 * GiB}
BACKWARD_TRANSIENT_PER_PARAM = 4


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    zero_stage: int
    checkpoint_interval: int  # activation checkpointing every N blocks (0 = off)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        ckpt = (f"activation checkpointing every {self.checkpoint_interval} block(s)"
                if self.checkpoint_interval else "no activation checkpointing")
        return (f"TP {self.tp} x PP {self.pp} x DP {self.dp} = {self.gpus} GPU(s), "
                f"ZeRO-{self.zero_stage}, {ckpt}")

    def sets(self) -> list[str]:
        """The `--set` arguments that select this layout."""
        return [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.dp={self.dp}",
                f"parallel.zero_stage={self.zero_stage}",
                f"parallel.activation_checkpoint_interval={self.checkpoint_interval}"]


@dataclass
class RankMemory:
    """One pipeline stage's rank (its TP and DP peers hold the same)."""

    stage: int
    parameters: int  # of this rank's shard
    gpu_parts: dict[str, int] = field(default_factory=dict)  # peak device bytes by part
    host_parts: dict[str, int] = field(default_factory=dict)

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu_parts.values())

    @property
    def host_total(self) -> int:
        return sum(self.host_parts.values())


@dataclass
class JobMemory:
    layout: Layout
    device: str  # "cuda" or "cpu": where the training state lives
    ranks: list[RankMemory]  # one per pipeline stage

    @property
    def peak(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.gpu_total)


@dataclass(frozen=True)
class NodeResources:
    """What a daemon reports of its node."""

    gpus: int
    gpu_bytes: int | None  # memory of each GPU; None on a CPU-only node
    host_bytes: int
    source: str = "measured"  # or "reported by --report-gpu-memory"
    # whether the CPU has fp16 kernels (oneDNN: AVX512-FP16 or AMX-FP16); None: not known
    cpu_fp16: bool | None = None


def layout_of(cfg: JobConfig) -> Layout:
    p = cfg.parallel
    return Layout(p.tp, p.pp, p.dp, p.zero_stage, p.activation_checkpoint_interval)


def _stage_params(cfg: JobConfig, layout: Layout) -> list[tuple[int, int, bool, bool]]:
    """(parameters, blocks, has embedding, has head) per stage, boundaries as the trainer
    computes them (partition.py)."""
    from .partition import layer_param_counts, stage_boundaries

    if layout_of(cfg) != layout:
        cfg = with_layout(cfg, layout)
    counts = layer_param_counts(cfg.model)
    bounds = stage_boundaries(cfg)
    last = len(counts) - 1
    out = []
    for start, stop in zip(bounds, bounds[1:], strict=False):
        layers = range(start, stop)
        blocks = sum(1 for i in layers if 0 < i < last)
        out.append((sum(counts[i] for i in layers), blocks, 0 in layers, last in layers))
    return out


def with_layout(cfg: JobConfig, layout: Layout) -> JobConfig:
    """The job at another layout (the partition by parameters, the global batch kept)."""
    p = cfg.parallel.model_copy(update={
        "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "zero_stage": layout.zero_stage,
        "activation_checkpoint_interval": layout.checkpoint_interval,
        "partition_method": "parameters" if layout.pp != cfg.parallel.pp
        else cfg.parallel.partition_method})
    return cfg.model_copy(update={"parallel": p})


def estimate(cfg: JobConfig, layout: Layout | None = None) -> JobMemory:
    """Predicted peak bytes of every stage's rank of `cfg` at `layout` (default: its own)."""
    layout = layout or layout_of(cfg)
    m, t = cfg.model, cfg.train
    tp, dp, zero = layout.tp, layout.dp, layout.zero_stage
    half = t.precision in ("bf16", "fp16")
    h = t.precision  # the 16-bit type's name in the labels
    elem = 2 if half else 4
    mb, s, d = t.micro_batch_size, m.seq_len, m.d_model
    gas = max(1, t.global_batch_size // (mb * dp)) if t.global_batch_size else 1
    widths = m.block_ffn_widths()
    f = max(widths)
    token_elems = mb * s * d  # one [micro-batch, seq, d_model] tensor
    per_block = elem * token_elems * (4 + (5 + 2 * f / d) / tp)
    ranks = []
    for stage, (params, blocks, _has_embed, has_head) in enumerate(_stage_params(cfg, layout)):
        P = math.ceil(params / tp)
        shard = P / dp if zero >= 1 else P
        gpu: dict[str, float] = {}
        if half and zero <= 1:
            gpu[f"weights ({h})"] = 2 * P
            gpu["gradient accumulator (fp32)"] = 4 * P
            gpu["master weights (fp32)"] = 4 * shard
            gpu["Adam moments (fp32)"] = 8 * shard
        elif half:
            gpu[f"weights ({h})"] = 2 * P / (dp if zero == 3 else 1)
            gpu["master weights (fp32)"] = 4 * P / dp
            gpu["Adam moments (fp32)"] = 8 * P / dp
            if zero == 3 and blocks:
                gpu[f"gathered block weights ({h})"] = 2 * 2 * params / max(blocks, 1) / tp
        else:
            gpu["weights (fp32)"] = 4 * P
            gpu["gradients (fp32)"] = 4 * P
            gpu["Adam moments (fp32)"] = 8 * shard
        in_flight = min(layout.pp - stage, gas)
        k = layout.checkpoint_interval
        if k and blocks:
            act = math.ceil(blocks / k) * elem * token_elems + min(k, blocks) * per_block
        else:
            act = blocks * per_block
        acts: dict[str, float] = {}
        if blocks:
            acts[f"activations ({in_flight} micro-batch(es) in flight)"] = in_flight * act
        if layout.pp > 1:
            acts["pipeline send/receive buffers"] = 2 * in_flight * elem * token_elems
        if has_head:
            logits = mb * s * (m.vocab_size // tp)
            if layout.pp > 1 or zero <= 1:  # the pipeline engine keeps the stage's outputs
                gpu["logits kept by the pipeline engine"] = elem * logits
            else:
                acts["logits"] = elem * logits
            acts["loss: gradient of the logits" + (" (fp32 softmax)" if tp > 1 else "")] = \
                (8 if tp > 1 else elem) * logits
        # ZeRO-2/3 reduce-scatter the gradients: the transient is this rank's partition
        # (unmeasured above DP 1, where it is the whole)
        transient = (BACKWARD_TRANSIENT_PER_PARAM * (P / dp if zero >= 2 else P)) if half else 0
        if sum(acts.values()) >= transient:
            gpu.update(acts)
        else:
            gpu[f"backward/optimizer transient ({h} grads, step)"] = transient
        rank = RankMemory(stage, P, {k_: int(v) for k_, v in gpu.items()})
        rank.host_parts = {"worker process": HOST_PROCESS_BYTES.get(cfg.launch.device, 2 * GiB),
                           "snapshot buffers (pinned on GPU nodes)":
                               int((elem * P + 12 * shard) * 1.1) + (64 << 20)}
        if cfg.launch.device == "cpu":  # the training state itself lives in host memory
            rank.host_parts["training state (on CPU)"] = rank.gpu_total
        ranks.append(rank)
    return JobMemory(layout, cfg.launch.device, ranks)


def gpu_needed(rank: RankMemory) -> int:
    """Device bytes a rank needs with the allocator's headroom and the CUDA context."""
    return int(rank.gpu_total * ALLOCATOR_HEADROOM) + CUDA_CONTEXT_BYTES


def problems(est: JobMemory, node: NodeResources, ranks_per_node: int) -> list[str]:
    """Why the job does not fit a node like `node` (empty: it fits)."""
    out = []
    peak = est.peak
    if est.device == "cuda" and node.gpu_bytes is not None:
        if gpu_needed(peak) > node.gpu_bytes:
            out.append(f"stage {peak.stage} needs {gib(gpu_needed(peak))} per GPU "
                       f"({gib(peak.gpu_total)} predicted peak x {ALLOCATOR_HEADROOM} allocator "
                       f"headroom + {gib(CUDA_CONTEXT_BYTES)} CUDA context); the node's GPUs have "
                       f"{gib(node.gpu_bytes)} ({node.source})")
        if ranks_per_node > node.gpus:
            out.append(f"{ranks_per_node} ranks per node, the node has {node.gpus} GPU(s)")
    host = max(r.host_total for r in est.ranks) * ranks_per_node
    if host > node.host_bytes:
        out.append(f"{ranks_per_node} rank(s) per node need {gib(host)} of host memory "
                   f"(worker processes, checkpoint snapshot buffers"
                   f"{', training state' if est.device == 'cpu' else ''}); the node has "
                   f"{gib(node.host_bytes)}")
    return out


def candidate_layouts(cfg: JobConfig, max_gpus: int = 4096) -> list[Layout]:
    """Layouts the job could run at, in the order the search prefers them: fewest GPUs, then
    no activation checkpointing, then less TP (communication), less PP (bubble), lower ZeRO."""
    from .config import validate_job
    from .errors import ConfigError

    m = cfg.model
    out = []
    for gpus in (2 ** i for i in range(0, 13)):
        if gpus > max_gpus:
            break
        found = []
        for tp in (1, 2, 4, 8):
            for pp in (1, 2, 4, 8, 16, 32, 64):
                if gpus % (tp * pp) or pp > m.n_layers or m.n_heads % tp or m.vocab_size % tp:
                    continue
                dp = gpus // (tp * pp)
                for zero in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                    for ckpt in (0, 1):
                        layout = Layout(tp, pp, dp, zero, ckpt)
                        try:
                            validate_job(_trial_config(cfg, layout))
                        except (ConfigError, ValueError):
                            continue
                        found.append(layout)
        found.sort(key=lambda lo: (lo.checkpoint_interval, lo.tp, lo.pp, lo.zero_stage))
        out.extend(found)
    return out


def _trial_config(cfg: JobConfig, layout: Layout) -> JobConfig:
    trial = with_layout(cfg, layout)
    launch = trial.launch.model_copy(update={"nnodes": 1, "nproc_per_node": layout.gpus,
                                             "min_nodes": None, "hosts": []})
    train = trial.train
    if train.global_batch_size and train.global_batch_size % (train.micro_batch_size * layout.dp):
        return trial  # validate_job says why
    return trial.model_copy(update={"launch": launch, "train": train.model_copy(
        update={"grad_accum_steps": None})})


def smallest_fitting(cfg: JobConfig, node: NodeResources) -> tuple[Layout, JobMemory] | None:
    """The first layout of `candidate_layouts` whose every rank fits a GPU of `node` and whose
    ranks on one node fit its host memory (as many ranks per node as it has GPUs)."""
    for layout in candidate_layouts(cfg):
        est = estimate(with_layout(cfg, layout), layout)
        if not problems(est, node, min(node.gpus or 1, layout.gpus)):
            return layout, est
    return None


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def breakdown(est: JobMemory) -> str:
    """Per-stage table of the predicted peak, part by part."""
    lines = [f"memory per rank at {est.layout.describe()} (predicted peak; "
             f"docs/memory-model.md):"]
    for r in est.ranks:
        where = "GPU" if est.device == "cuda" else "device"
        lines.append(f"  stage {r.stage} ({r.parameters / 1e6:,.0f}M parameters per rank): "
                     f"{where} {gib(r.gpu_total)}, host {gib(r.host_total)}")
        for name, n in r.gpu_parts.items():
            lines.append(f"    {name:52} {gib(n):>11}")
        for name, n in r.host_parts.items():
            lines.append(f"    host: {name:46} {gib(n):>11}")
    return "\n".join(lines)


def as_dict(est: JobMemory) -> dict[str, Any]:
    return {"layout": est.layout.__dict__, "ranks": [
        {"stage": r.stage, "parameters": r.parameters, "gpu_bytes": r.gpu_total,
         "host_bytes": r.host_total, "gpu_parts": r.gpu_parts, "host_parts": r.host_parts}
        for r in est.ranks]}
