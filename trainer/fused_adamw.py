"""AdamW's update of BF16_Optimizer's fp32 master weights fused with the two memory passes
DeepSpeed 0.19 makes around it, on CUDA.

BF16_Optimizer keeps the fp32 master weights, their gradients and AdamW's two moments as one
flat partition per parameter group (1.41B elements each for the 1.4B model at DP 1). A step
then makes three passes over them: the gradient clip multiplies the fp32 gradients in place
(read + write, 11.3 GB), `torch.optim.AdamW` updates weights and moments (39.6 GB), and
`update_lp_params` copies the fp32 weights into the bf16 partition the model computes with
(8.5 GB). One Triton kernel here reads weight, gradient and both moments once, applies the clip
coefficient, AdamW's decoupled decay and update, and writes weight, moments and the bf16 copy:
42.4 GB instead of 59.4 GB (~5 ms a step on an H100's 3.35 TB/s, docs/performance.md).

The arithmetic is `torch.optim.AdamW`'s (the fused CUDA kernel's order: decay, moments, bias
corrections, update), in fp32, with the clipped gradient `g * coef` exactly as DeepSpeed's clip
computes it; the weights may differ from torch's kernel in the last bits (a different compiler's
contractions), well within bf16 rounding (tests/gpu/test_fused_adamw.py). The optimizer's state
stays torch's own (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints and a later switch back to
torch's step read it unchanged.

Used by trainer/bf16_fastpath.py's step only where it computes what torch's AdamW would: a CUDA
partition, Triton importable, `torch.optim.AdamW` (or Adam with decoupled weight decay) without
amsgrad, maximize, capturable, differentiable or tensor hyperparameters, no optimizer step
hooks, the moments already created by a first torch step, fp32 gradient accumulation.
DS3D_FUSED_KERNELS=0 switches it off with the other kernels (trainer/kernels.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

try:  # Triton comes with CUDA builds of torch; CPU-only installs have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 2048

if triton is not None:

    @triton.jit
    def _adamw_kernel(weight, grad, exp_avg, exp_avg_sq, weight_lp, coef_ptr, corr_ptr, n,
                      decay, beta1, beta2, eps, step_size, bc2_sqrt,
                      CLIP: tl.constexpr, CORR_ON_DEVICE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(weight + offs, mask=mask)
        g = tl.load(grad + offs, mask=mask)
        m = tl.load(exp_avg + offs, mask=mask)
        v = tl.load(exp_avg_sq + offs, mask=mask)
        if CLIP:
            g = g * tl.load(coef_ptr)
        if CORR_ON_DEVICE:  # [lr / (1 - beta1^t), sqrt(1 - beta2^t)] from the step on the GPU
            step_size = tl.load(corr_ptr)
            bc2_sqrt = tl.load(corr_ptr + 1)
        p = p * decay
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(weight + offs, p, mask=mask)
        tl.store(exp_avg + offs, m, mask=mask)
        tl.store(exp_avg_sq + offs, v, mask=mask)
        tl.store(weight_lp + offs, p.to(weight_lp.dtype.element_ty), mask=mask)


@dataclass
class Partition:
    """One parameter group's flat partition: what the kernel reads and writes."""
    weight: torch.Tensor  # fp32 master weights (the optimizer's parameter)
    grad: torch.Tensor  # fp32 gradients
    weight_lp: torch.Tensor  # the bf16 copy the model computes with
    state: dict[str, Any]  # the optimizer's: step, exp_avg, exp_avg_sq
    group: dict[str, Any]  # the optimizer's param group: lr, betas, eps, weight_decay


def _hooked(optimizer: torch.optim.Optimizer) -> bool:
    from torch.optim import optimizer as optim_module

    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None) or
                getattr(optimizer, "_optimizer_step_post_hooks", None) or
                getattr(optim_module, "_global_optimizer_pre_hooks", None) or
                getattr(optim_module, "_global_optimizer_post_hooks", None))


def _plain_adamw_group(group: dict[str, Any]) -> bool:
    return (group.get("decoupled_weight_decay", False) and not group.get("amsgrad", False)
            and not group.get("maximize", False) and not group.get("capturable", False)
            and not group.get("differentiable", False)
            and all(isinstance(group[k], float | int) for k in ("lr", "eps", "weight_decay"))
            and all(isinstance(b, float | int) for b in group["betas"]))


def partitions(opt: Any) -> list[Partition] | None:
    """The fused step's work for this BF16_Optimizer `opt`, or None where torch's AdamW step
    must run (module docstring: the conditions)."""
    inner = opt.optimizer
    if triton is None or os.environ.get("DS3D_FUSED_KERNELS", "1") == "0" or \
            not isinstance(inner, torch.optim.Adam) or _hooked(inner) or \
            opt.grad_acc_dtype is not torch.float32:
        return None
    out = []
    for i, (weight, grad) in enumerate(zip(opt.fp32_groups_flat_partition,
                                           opt.fp32_groups_gradient_flat_partition, strict=True)):
        group = next((g for g in inner.param_groups if any(p is weight for p in g["params"])),
                     None)
        state = inner.state.get(weight)
        partition_id = _dp_rank(opt, i)
        lp = opt.bf16_partitioned_groups[i][partition_id]
        if group is None or not _plain_adamw_group(group) or not state or \
                not {"step", "exp_avg", "exp_avg_sq"} <= state.keys() or \
                not weight.is_cuda or weight.dtype != torch.float32 or \
                grad.dtype != torch.float32 or lp.numel() != weight.numel() or \
                any(not t.is_contiguous() or t.device != weight.device for t in
                    (grad, lp, state["exp_avg"], state["exp_avg_sq"])) or \
                state["exp_avg"].dtype != torch.float32 or \
                state["exp_avg_sq"].dtype != torch.float32:
            return None
        out.append(Partition(weight, grad, lp, state, group))
    return out


def _dp_rank(opt: Any, i: int) -> int:
    from deepspeed import comm as dist

    return int(dist.get_rank(group=opt.real_dp_process_group[i]))


def step_(work: list[Partition], coef: torch.Tensor | None) -> None:
    """One AdamW step of every partition in `work`, its gradients multiplied by the clip
    coefficient `coef` (a one-element fp32 tensor on the device; None: no clip), the updated
    weights also written to the bf16 copies. Queues GPU work only (no host sync)."""
    for part in work:
        group, state = part.group, part.state
        lr = float(group["lr"])
        beta1, beta2 = (float(b) for b in group["betas"])
        step = state["step"]
        step.add_(1)  # torch's AdamW counts first, then corrects by the new count
        corr = None
        step_size = bc2_sqrt = 1.0
        if step.is_cuda:  # fused/capturable AdamW keeps it on the GPU: no host read of it
            t = step.float()
            corr = torch.stack([lr / (1 - torch.pow(beta1, t)),
                                torch.sqrt(1 - torch.pow(beta2, t))])
        else:
            t = float(step)
            step_size, bc2_sqrt = lr / (1 - beta1 ** t), math.sqrt(1 - beta2 ** t)
        n = part.weight.numel()
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            part.weight, part.grad, state["exp_avg"], state["exp_avg_sq"], part.weight_lp,
            coef if coef is not None else part.weight, corr if corr is not None else part.weight,
            n, 1.0 - lr * float(group["weight_decay"]), beta1, beta2, float(group["eps"]),
            step_size, bc2_sqrt, CLIP=coef is not None, CORR_ON_DEVICE=corr is not None,
            BLOCK=BLOCK)
