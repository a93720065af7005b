"""Megatron-style tensor parallelism over one TP process group.

A column-parallel linear splits its output features over the TP ranks; a row-parallel linear
splits its input features and sums the partial products with one all-reduce. Paired as
column -> row (QKV -> out-proj, FC1 -> FC2), a block needs one all-reduce forward and one
backward per pair. The vocabulary-parallel embedding and cross-entropy split the vocabulary so
that no rank ever holds full-vocabulary logits.

Every sharded parameter is marked `tensor_model_parallel = True` (DeepSpeed's gradient-norm code
counts unmarked parameters once per TP group, marked ones on every rank), and carries
`partition_dim` so checkpoint tools know how to join the shards.

Weights are initialised from the full, unsharded tensor drawn from a generator seeded by
(seed, layer, parameter name) and then sliced, so that a model is the same function at every
(TP, PP, DP) layout: this is what makes the layouts numerically comparable.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .kernels import cross_entropy_mean


class TPGroup:
    """The TP process group and this rank's place in it (a group of one when TP = 1)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        return full.chunk(self.size, dim=dim)[self.rank].contiguous()


# --- communication as autograd functions ----------------------------------------------------


class CollectiveClock:
    """Seconds this rank spends inside its TP all-reduces while on (a step that
    trainer/step_timing.py samples): its waits for its TP peers. The peers of a slow rank wait
    for it in every all-reduce, so their compute time grows as much as its own; this is what
    tells the slow one apart (it waits least). On a GPU the device is synchronised around each
    all-reduce while on, so that the time is the collective's, not the kernels queued before."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0
        self.count = 0

    def start(self) -> None:
        self.on, self.seconds, self.count = True, 0.0, 0

    def stop(self) -> float | None:
        """The seconds, or None when no all-reduce was timed (TP = 1, or a compiled model,
        whose collectives run inside the graph): then nothing was measured, not 0 s."""
        self.on = False
        return self.seconds if self.count else None


TP_WAIT = CollectiveClock()


def _all_reduce(x: torch.Tensor, tp: TPGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                ) -> None:
    # is_compiling first: torch.compile traces the plain call and installs no guard on the
    # clock (a guard would recompile the graph at every sampled step)
    if torch.compiler.is_compiling() or not TP_WAIT.on:
        dist.all_reduce(x, op=op, group=tp.group)
        return
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    dist.all_reduce(x, op=op, group=tp.group)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    TP_WAIT.seconds += time.perf_counter() - t0
    TP_WAIT.count += 1


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient backward (enters a column-parallel op)."""

    @staticmethod
    def forward(ctx, x, tp):  # type: ignore[override]
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.tp.size > 1:
            grad = grad.contiguous()
            _all_reduce(grad, ctx.tp)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (leaves a row-parallel op)."""

    @staticmethod
    def forward(ctx, x, tp):  # type: ignore[override]
        if tp.size > 1:
            x = x.contiguous()
            _all_reduce(x, tp)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, tp) if tp.size > 1 else x


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp) if tp.size > 1 else x


# --- initialisation ---------------------------------------------------------------------------


def seeded_normal(shape: tuple[int, ...], std: float, seed: int, device: torch.device,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A full tensor that depends only on (shape, std, seed, device type), never on the layout.
    On the meta device (a model whose weights will be loaded) nothing is drawn."""
    if device.type == "meta":
        return torch.empty(shape, device=device, dtype=dtype)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(std).to(dtype)


def _mark(p: nn.Parameter, partition_dim: int) -> nn.Parameter:
    p.tensor_model_parallel = True  # type: ignore[attr-defined]
    p.partition_dim = partition_dim  # type: ignore[attr-defined]
    return p


# --- layers -----------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T + b_local, with W split by output rows. Input replicated.

    `groups` > 1 keeps sub-matrices (Q, K, V) contiguous per rank: the full weight is viewed as
    [groups, out/groups, in] and split along the second axis, so each rank holds its heads' Q, K
    and V. The parameter is stored in that 3-D shape so shards join along one axis (1).
    """

    def __init__(self, d_in: int, d_out: int, tp: TPGroup, seed: int, std: float,
                 groups: int = 1, bias: bool = True) -> None:
        super().__init__()
        self.tp, self.groups = tp, groups
        device = torch.get_default_device()
        full = seeded_normal((groups, d_out // groups, d_in), std, seed, device)
        self.weight = _mark(nn.Parameter(tp.shard(full, dim=1)), partition_dim=1)
        self.bias = (_mark(nn.Parameter(torch.zeros(groups, d_out // groups // tp.size)), 1)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp)
        w = self.weight.reshape(-1, self.weight.shape[-1])
        b = self.bias.reshape(-1) if self.bias is not None else None
        return F.linear(x, w, b)


class RowParallelLinear(nn.Module):
    """y = sum_ranks(x_local @ W_local^T) + b, with W split by input columns. Output replicated."""

    def __init__(self, d_in: int, d_out: int, tp: TPGroup, seed: int, std: float,
                 bias: bool = True) -> None:
        super().__init__()
        self.tp = tp
        device = torch.get_default_device()
        full = seeded_normal((d_out, d_in), std, seed, device)
        self.weight = _mark(nn.Parameter(tp.shard(full, dim=1)), partition_dim=1)
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None  # replicated on TP ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # the bias fused into the matmul's epilogue
            return F.linear(x, self.weight, self.bias)
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each TP rank holds rows [start, end) of the table; out-of-range tokens read zeros, and one
    all-reduce assembles the full embedding."""

    def __init__(self, vocab: int, d: int, tp: TPGroup, seed: int, std: float) -> None:
        super().__init__()
        self.tp = tp
        self.per_rank = vocab // tp.size
        self.start = tp.rank * self.per_rank
        full = seeded_normal((vocab, d), std, seed, torch.get_default_device())
        self.weight = _mark(nn.Parameter(tp.shard(full, dim=0)), partition_dim=0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy from vocab-sharded logits: max, sum-exp and the target logit are
    each combined with one all-reduce; the gradient is softmax - onehot, computed locally."""

    @staticmethod
    def forward(ctx, logits, targets, tp):  # type: ignore[override]
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        if tp.size > 1:
            _all_reduce(local_max, tp, op=dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        per_rank = logits.shape[-1]
        start = tp.rank * per_rank
        local_t = targets - start
        outside = (local_t < 0) | (local_t >= per_rank)
        local_t = local_t.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if tp.size > 1:
            stacked = torch.stack([target_logit, sum_exp])
            _all_reduce(stacked, tp)
            target_logit, sum_exp = stacked[0], stacked[1]
        loss = sum_exp.log() - target_logit  # [batch, seq]
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside)
        ctx.count = loss.numel()
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        softmax, local_t, outside = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, local_t.unsqueeze(-1), (~outside).unsqueeze(-1).to(g.dtype).neg())
        g.mul_(grad / ctx.count)
        return g, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return cross_entropy_mean(logits, targets)
    return _VocabParallelCrossEntropy.apply(logits, targets, tp)
