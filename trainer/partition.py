"""Pipeline stage boundaries: from the job's method, or from measured per-layer costs.

A GPT pipeline has n + 2 layers (0 = embedding, 1..n = blocks, n + 1 = head with the loss) and
p stages; a partition is the list of p + 1 layer indices where each stage starts, plus the end
(`[0, 5, 10]`: layers 0-4 on stage 0, 5-9 on stage 1).

* `stage_boundaries(cfg, run_dir)`: what a job runs with. `RUN_DIR/partition.json` (written when
  a measured partition was decided, or by `ds3dctl rebalance`) wins over the configured method,
  so every later restart of the job keeps it; otherwise `parameters` (DeepSpeed's balanced split
  of parameter counts, also the start of `measured`), `uniform` or explicit blocks per stage.
* `best_partition(costs, p)`: the linear-partition dynamic programme over measured costs:
  minimise the slowest stage, subject to a per-stage memory limit when one is known; among the
  partitions with that slowest stage, the one with the smallest sum of squared stage times.
* `predict(costs, parts, m)`: per-stage times and what they mean for a 1F1B step of m
  micro-batches: step ≈ (m + p − 1) × slowest stage, bubble = 1 − m·Σ stage / (p (m + p − 1)
  slowest) (the idle share of the p stages over the step; (p − 1)/(m + p − 1) when balanced).

Pure Python (no torch, no deepspeed), so that ds3dd and ds3dctl use the same code as the trainer.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import JobConfig, ModelConfig
from .fileio import atomic_write_text
from .kinds import RecordKind

# unhooked steps of a profile window, timing each stage's total (layer_profile)
CALIBRATION_STEPS = 2

PARTITION_FILE = "partition.json"
PROFILE_DIR = "profile"
LAYER_COSTS_FILE = "layer-costs.json"
FORMAT = 1


# --------------------------------------------------------------------------------------------
# Layers and the configured methods


def layer_names(n_layers: int) -> list[str]:
    return ["embedding"] + [f"block {i}" for i in range(n_layers)] + ["head"]


def layer_param_counts(cfg: ModelConfig) -> list[int]:
    """Parameters of each pipeline layer, computed, not built (building a 10B model on every
    rank just to count it would cost minutes)."""
    d, v = cfg.d_model, cfg.vocab_size
    blocks = [4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d for f in cfg.block_ffn_widths()]
    return [v * d] + blocks + [d * v + 2 * d]


def deepspeed_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's `partition_balanced` (runtime/utils.py), so that the daemon shows the
    boundaries the trainer uses without importing deepspeed: the split whose heaviest minus
    lightest part is smallest (ties: the last candidate). Checked equal to DeepSpeed's in
    tests/unit/test_partition.py."""
    n, m = len(weights), num_parts
    if n <= m:
        return [min(i, n) for i in range(m + 1)]
    return list(_balanced(tuple(float(w) for w in weights), m))


@functools.lru_cache(maxsize=32)
def _balanced(weights: tuple[float, ...], m: int) -> tuple[int, ...]:
    """DeepSpeed's O(n^2 m) dynamic program with its inner loop over the split point k in
    numpy: in Python it took minutes for a 1024-layer model at PP 64, and the daemon's fit
    check runs it for every PP it considers (cached: the layouts of one search share
    weights). Same float operations in the same order, so the same answer: the cost of
    stage j ending at layer i is max - min over the stages, minimised over k; of equal
    costs, DeepSpeed's `>=` keeps the last k."""
    import numpy as np

    n = len(weights)
    prefix = [0.0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + w
    total = np.array(prefix)
    dp_max = np.full((n + 1, m + 1), math.inf)
    dp_min = np.full((n + 1, m + 1), math.inf)
    position = np.zeros((n + 1, m + 1), dtype=np.int64)
    dp_max[0, 0] = 0.0
    for j in range(1, m + 1):
        # stage j ends at layer i >= j and starts after layer k, j-1 <= k < i (a smaller k
        # leaves fewer layers than stages before it: infinite cost, never chosen)
        i = np.arange(j, n + 1)[:, None]
        k = np.arange(j - 1, n)[None, :]
        part = total[i] - total[k]
        hi = np.maximum(dp_max[j - 1:n, j - 1][None, :], part)
        lo = np.minimum(dp_min[j - 1:n, j - 1][None, :], part)
        cost = np.where(k < i, hi - lo, math.inf)
        best = cost.min(axis=1, keepdims=True)
        last = cost.shape[1] - 1 - np.argmax((cost == best)[:, ::-1], axis=1)
        rows = np.arange(len(last))
        dp_max[j:, j] = hi[rows, last]
        dp_min[j:, j] = lo[rows, last]
        position[j:, j] = last + (j - 1)
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    parts.reverse()
    return tuple(parts)


def method_boundaries(cfg: JobConfig) -> list[int]:
    """Boundaries from `parallel.partition_method` alone (no partition.json)."""
    p, n = cfg.parallel, cfg.model.n_layers
    method = p.partition_method
    if isinstance(method, list) or method == "uniform":
        blocks = method if isinstance(method, list) else [n // p.pp] * p.pp
        parts, acc = [0], 1
        for count in blocks[:-1]:
            acc += count
            parts.append(acc)
        return parts + [n + 2]
    return keep_embedding_company(deepspeed_balanced(layer_param_counts(cfg.model), p.pp))


# layers stage 0 holds at least: the embedding and a transformer block (keep_embedding_company)
FIRST_STAGE_MIN_LAYERS = 2


def keep_embedding_company(parts: Sequence[int]) -> list[int]:
    """Moves the first boundary so that stage 0 holds a transformer block besides the embedding,
    shifting later boundaries as needed. A first stage of the embedding alone hangs DeepSpeed's
    ZeRO step (seen at PP = 4 on gloo: rank 0 goes on to the loss broadcast while the other
    stages wait in the optimizer's grad-norm all-reduce); the parameter balance picks exactly
    that split when the vocabulary is large."""
    out = list(parts)
    if len(out) > 2 and out[1] < FIRST_STAGE_MIN_LAYERS:
        out[1] = FIRST_STAGE_MIN_LAYERS
        for k in range(2, len(out) - 1):
            out[k] = max(out[k], out[k - 1] + 1)
    return out


def check_boundaries(parts: Sequence[int], n_layers: int, stages: int) -> str | None:
    """Why `parts` is not a partition of the n + 2 layers into `stages` non-empty stages
    (None when it is one)."""
    if len(parts) != stages + 1:
        return f"{len(parts)} boundaries for {stages} stages (need {stages + 1})"
    if parts[0] != 0 or parts[-1] != n_layers + 2:
        return f"boundaries must start at 0 and end at {n_layers + 2} (the layer count)"
    if any(b <= a for a, b in zip(parts, parts[1:], strict=False)):
        return "every stage needs at least one layer (boundaries strictly increasing)"
    return None


def check_runnable(parts: Sequence[int], n_layers: int, stages: int) -> str | None:
    """`check_boundaries`, and what DeepSpeed can run: not the embedding alone on stage 0
    (keep_embedding_company)."""
    problem = check_boundaries(parts, n_layers, stages)
    if problem is None and stages > 1 and parts[1] < FIRST_STAGE_MIN_LAYERS:
        problem = "stage 0 needs a transformer block besides the embedding"
    return problem


# --------------------------------------------------------------------------------------------
# partition.json: the decided partition, read at every start


@dataclass(frozen=True)
class Partition:
    boundaries: list[int]
    # "parameters", "uniform", "explicit", "measured", "rebalance", or "checkpoint" (a re-split
    # the checkpoint could not be converted to: its own split kept, trainer/loop.py)
    source: str
    detail: dict[str, Any] = field(default_factory=dict)  # partition.json, when it came from one


def read_partition_file(run_dir: str | Path | None, cfg: JobConfig) -> dict[str, Any] | None:
    """RUN_DIR/partition.json when it fits this job (same model, stage count); else None. A file
    that does not fit (the job was restarted with another pp or model) is ignored, not fatal;
    so is one that is no partition file at all (not a JSON object, boundaries that are not
    integers: `ds3dctl status` shows the source the job falls back to), since every GetJob,
    ListJobs and launch reads it."""
    if run_dir is None:
        return None
    try:
        data = json.loads((Path(run_dir) / PARTITION_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    parts = data.get("boundaries")
    if not isinstance(parts, list) or not all(type(b) is int for b in parts) or \
            data.get("model_hash") not in (None, cfg.model_hash()) or \
            check_runnable(parts, cfg.model.n_layers, cfg.parallel.pp) is not None:
        return None
    return dict(data)


def current_partition(cfg: JobConfig, run_dir: str | Path | None = None) -> Partition:
    """The partition a (re)start of the job uses, and where it comes from."""
    data = read_partition_file(run_dir, cfg)
    if data is not None:
        return Partition([int(b) for b in data["boundaries"]], str(data.get("source", "measured")),
                         data)
    method = cfg.parallel.partition_method
    source = "explicit" if isinstance(method, list) else \
        "parameters" if method == "measured" else method
    return Partition(method_boundaries(cfg), source)


def stage_boundaries(cfg: JobConfig, run_dir: str | Path | None = None) -> list[int]:
    """Layer indices where each pipeline stage starts (plus the end)."""
    return current_partition(cfg, run_dir).boundaries


def write_partition_file(run_dir: str | Path, cfg: JobConfig, boundaries: Sequence[int],
                         source: str, **detail: Any) -> Path:
    """Writes RUN_DIR/partition.json atomically (tmp + rename): a start reads the old file or
    the new one, never half of one."""
    problem = check_runnable(boundaries, cfg.model.n_layers, cfg.parallel.pp)
    if problem:
        raise ValueError(f"partition {list(boundaries)}: {problem}")
    path = Path(run_dir) / PARTITION_FILE
    data = {"format": FORMAT, "boundaries": [int(b) for b in boundaries], "source": source,
            "pp": cfg.parallel.pp, "n_layers": cfg.model.n_layers,
            "model_hash": cfg.model_hash(), "time": round(time.time(), 3), **detail}
    atomic_write_text(path, json.dumps(data, indent=1, default=float))
    return path


# --------------------------------------------------------------------------------------------
# Measured costs


@dataclass(frozen=True)
class LayerCost:
    """One pipeline layer as measured on the ranks that run it (median over them)."""

    layer: int
    forward_s: float         # seconds per micro-batch (the head's includes the loss)
    backward_s: float        # seconds per micro-batch
    params: int = 0          # parameters on one rank (its TP shard)
    activation_bytes: int = 0  # bytes saved for backward per micro-batch (not parameters)

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class MemoryModel:
    """What a stage holds: `bytes_per_param` per parameter (weights, gradients, optimizer state
    on this rank) plus the activations of the micro-batches in flight, min(p − stage, m) under
    1F1B. `limit_bytes` per stage (None: no limit known, e.g. on CPU)."""

    bytes_per_param: float
    limit_bytes: float | None = None


def bytes_per_param(precision: str, zero_stage: int, dp: int) -> float:
    """Weights + gradients + Adam state per parameter on one rank (ZeRO-1 shards the optimizer
    state over DP). bf16 keeps an fp32 gradient accumulator and fp32 master weights."""
    shard = dp if zero_stage >= 1 else 1
    if precision == "fp32":
        return 4 + 4 + 8 / shard
    if precision == "bf16":
        return 2 + 2 + 4 + (4 + 8) / shard
    return 2 + 2 + (4 + 8) / shard  # fp16: master weights + moments


def in_flight(stage: int, stages: int, micro_batches: int) -> int:
    return max(1, min(stages - stage, micro_batches))


def stage_memory(costs: Sequence[LayerCost], parts: Sequence[int], micro_batches: int,
                 memory: MemoryModel) -> list[int]:
    p = len(parts) - 1
    out = []
    for k in range(p):
        layers = costs[parts[k]:parts[k + 1]]
        static = sum(c.params for c in layers) * memory.bytes_per_param
        act = sum(c.activation_bytes for c in layers) * in_flight(k, p, micro_batches)
        out.append(int(static + act))
    return out


@dataclass(frozen=True)
class Prediction:
    boundaries: list[int]
    stage_s: list[float]       # seconds per micro-batch of each stage (forward + backward)
    slowest_s: float
    step_s: float              # (m + p - 1) x slowest stage
    bubble: float              # 1 - m sum(stage_s) / (p (m + p - 1) slowest)
    stage_memory_bytes: list[int]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict(costs: Sequence[LayerCost], parts: Sequence[int], micro_batches: int,
            memory: MemoryModel | None = None) -> Prediction:
    p, m = len(parts) - 1, micro_batches
    stage = [sum(c.seconds for c in costs[parts[k]:parts[k + 1]]) for k in range(p)]
    slowest = max(stage)
    span = (m + p - 1) * slowest
    bubble = 1.0 - m * sum(stage) / (p * span) if span > 0 else 0.0
    mem = stage_memory(costs, parts, m, memory) if memory is not None else [0] * p
    return Prediction(list(parts), stage, slowest, span, bubble, mem)


class PartitionError(ValueError):
    """No partition satisfies the constraints (e.g. the memory limit)."""


def best_partition(costs: Sequence[float], stages: int, *,
                   static_bytes: Sequence[float] | None = None,
                   activation_bytes: Sequence[float] | None = None,
                   micro_batches: int = 1, limit_bytes: float | None = None,
                   first_at_least: int = 1) -> list[int]:
    """Contiguous split of `costs` into `stages` non-empty parts minimising the largest part's
    sum; with `limit_bytes`, each stage k must satisfy Σ static + in_flight(k) Σ activation
    ≤ limit; the first stage holds at least `first_at_least` layers. Among the optimal splits,
    the one with the smallest Σ part² (most even). O(p n²). Raises PartitionError when no split
    fits the memory limit."""
    n, p = len(costs), stages
    if not 1 <= p <= n:
        raise PartitionError(f"cannot split {n} layers into {p} non-empty stages")
    pre = _prefix(costs)
    pre_s = _prefix(static_bytes or [0.0] * n)
    pre_a = _prefix(activation_bytes or [0.0] * n)

    def fits(k: int, i: int, j: int) -> bool:
        if k == 0 and p > 1 and j - i < first_at_least:
            return False
        if limit_bytes is None:
            return True
        need = pre_s[j] - pre_s[i] + in_flight(k, p, micro_batches) * (pre_a[j] - pre_a[i])
        return need <= limit_bytes

    inf = math.inf
    # pass 1: best[k][j] = smallest slowest stage covering layers [0, j) with stages 0..k-1
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] < inf and fits(k - 1, i, j):
                    best[k][j] = min(best[k][j], max(best[k - 1][i], pre[j] - pre[i]))
    bound = best[p][n]
    if bound == inf:
        raise PartitionError(f"no split of {n} layers into {p} stages fits "
                             + (f"{limit_bytes:.3g} bytes per stage" if limit_bytes else
                                f"a first stage of at least {first_at_least} layers"))
    cap = bound * (1 + 1e-9) + 1e-15
    # pass 2: among splits whose stages all stay within `bound`, the smallest sum of squares
    sq = [[inf] * (n + 1) for _ in range(p + 1)]
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    sq[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            for i in range(k - 1, j):
                w = pre[j] - pre[i]
                if sq[k - 1][i] < inf and w <= cap and fits(k - 1, i, j) and \
                        sq[k - 1][i] + w * w < sq[k][j]:
                    sq[k][j], cut[k][j] = sq[k - 1][i] + w * w, i
    parts = [n]
    for k in range(p, 0, -1):
        parts.append(cut[k][parts[-1]])
    return parts[::-1]


def _prefix(values: Iterable[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + float(v))
    return out


@dataclass(frozen=True)
class Proposal:
    current: Prediction
    proposed: Prediction
    improvement: float   # 1 - proposed slowest / current slowest
    threshold: float
    micro_batches: int

    @property
    def worth_it(self) -> bool:
        """The measured partition is different and faster by more than the threshold."""
        return self.proposed.boundaries != self.current.boundaries and \
            self.improvement > self.threshold

    def as_dict(self) -> dict[str, Any]:
        return {"current": self.current.as_dict(), "proposed": self.proposed.as_dict(),
                "improvement": self.improvement, "threshold": self.threshold,
                "micro_batches": self.micro_batches}


def propose(costs: Sequence[LayerCost], current: Sequence[int], micro_batches: int,
            threshold: float, memory: MemoryModel | None = None) -> Proposal:
    """The measured-best partition beside the current one, both predicted from `costs`. When
    no partition fits the memory limit, the current one is proposed (no change)."""
    p = len(current) - 1
    try:
        best = best_partition(
            [c.seconds for c in costs], p, micro_batches=micro_batches,
            static_bytes=[c.params * memory.bytes_per_param for c in costs] if memory else None,
            activation_bytes=[c.activation_bytes for c in costs] if memory else None,
            limit_bytes=memory.limit_bytes if memory else None,
            first_at_least=FIRST_STAGE_MIN_LAYERS)
    except PartitionError:
        best = list(current)
    now = predict(costs, current, micro_batches, memory)
    new = predict(costs, best, micro_batches, memory)
    gain = 1.0 - new.slowest_s / now.slowest_s if now.slowest_s > 0 else 0.0
    return Proposal(now, new, gain, threshold, micro_batches)


# --------------------------------------------------------------------------------------------
# Profile records (one per rank: the layers of its stage) -> one cost per layer


def merge_profile_records(records: Iterable[dict[str, Any]],
                          n_layers: int) -> dict[str, Any] | None:
    """Merges `profile` report records of every rank into one cost per layer: the median over
    the ranks that ran the layer in the newest profile round that measured it (a round = one
    gathered profile, named by its `round`, rank 0's clock when it was gathered); older rounds
    fill layers a newer one lacks (costs belong to layers, not to the partition they were
    measured in). None until every layer has been measured.

    Returns {"layers": [LayerCost], "step", "micro_batches", "memory_limit_bytes",
    "bytes_per_param", "partition" (the one measured in the newest round)}."""
    rounds: dict[tuple[float, int], list[dict[str, Any]]] = {}
    for rec in records:
        if rec.get("kind") != RecordKind.PROFILE or not isinstance(rec.get("layers"), list):
            continue
        key = (float(rec.get("round", rec.get("time", 0.0))), int(rec.get("step", 0)))
        rounds.setdefault(key, []).append(rec)
    if not rounds:
        return None
    total = n_layers + 2
    merged: dict[int, LayerCost] = {}
    newest = rounds[max(rounds)]
    for key in sorted(rounds, reverse=True):
        per_layer: dict[int, list[dict[str, Any]]] = {}
        for rec in rounds[key]:
            for layer in rec["layers"]:
                per_layer.setdefault(int(layer["layer"]), []).append(layer)
        for idx, rows in per_layer.items():
            if idx in merged or not 0 <= idx < total:
                continue
            merged[idx] = LayerCost(
                idx, statistics.median(float(r["forward_s"]) for r in rows),
                statistics.median(float(r["backward_s"]) for r in rows),
                max(int(r.get("params", 0)) for r in rows),
                max(int(r.get("activation_bytes", 0)) for r in rows))
        if len(merged) == total:
            break
    if len(merged) < total:
        return None
    head = newest[0]
    limits = [r["memory_limit_bytes"] for r in newest if r.get("memory_limit_bytes")]
    return {"layers": [merged[i] for i in range(total)], "step": int(head.get("step", 0)),
            "micro_batches": int(head.get("micro_batches", 1)),
            "partition": list(head.get("partition") or []),
            "bytes_per_param": float(head.get("bytes_per_param", 0.0)),
            "memory_limit_bytes": min(limits) if limits else None}


def memory_model(merged: dict[str, Any]) -> MemoryModel | None:
    if not merged.get("bytes_per_param"):
        return None
    return MemoryModel(merged["bytes_per_param"], merged.get("memory_limit_bytes"))


def costs_json(merged: dict[str, Any], proposal: Proposal | None = None,
               names: Sequence[str] | None = None) -> str:
    """The content of RUN_DIR/profile/layer-costs.json."""
    layers = []
    for c in merged["layers"]:
        row = asdict(c)
        if names is not None:
            row["name"] = names[c.layer]
        layers.append(row)
    out = {k: v for k, v in merged.items() if k != "layers"}
    out["layers"] = layers
    if proposal is not None:
        out["proposal"] = proposal.as_dict()
    return json.dumps(out, indent=1, default=float)


def write_layer_costs(run_dir: str | Path, text: str) -> Path:
    path = Path(run_dir) / PROFILE_DIR / LAYER_COSTS_FILE
    atomic_write_text(path, text)
    return path


def fmt_boundaries(parts: Sequence[int]) -> str:
    return "|".join(str(b) for b in parts)
