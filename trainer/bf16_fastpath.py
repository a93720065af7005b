"""The hot spots of DeepSpeed's BF16_Optimizer (0.19, used for bf16 with ZeRO 0/1), replaced by
the same arithmetic with fewer kernel launches, fewer memory passes and no extra host sync.
Profiled on an H200 with the 1.4B model (docs/performance.md), DeepSpeed's per-parameter
optimizer work (~300 parameters, several kernels each) left the GPU waiting on the host.

* `update_hp_grads` adds each bf16 gradient into its fp32 accumulator as
  `hp.add_(lp.grad.to(fp32))`: per parameter a converting copy (an fp32 temporary) then the add.
  Here a parameter's first gradient since the accumulators were cleared is converted into its
  accumulator by one `torch._foreach_copy_` over all of them (the bf16 -> fp32 conversion is
  exact, so 0 + g == g); later micro-batches of the same step add as DeepSpeed does, with one
  converting add. One difference in bits, none in results: an exact zero gradient of sign minus
  stays -0.0 where DeepSpeed's 0.0 + (-0.0) stores +0.0; every reader gives identical bits for
  either (the norm squares it, the clip multiplies it, the DP reduction sums it, Adam/AdamW and
  SGD add a multiple of it to a moment or weight), which tests/unit/test_bf16_fastpath.py checks
  on gradients that hold such zeros.
* zeroing the accumulators: DeepSpeed zeroes the whole fp32 gradient buffer after every step
  (twice: `step` and the engine's `zero_grad` both call `clear_hp_grads`), one full memory pass,
  although the next step's first gradients overwrite it by copy. Here `clear_hp_grads` only
  resets the "has a gradient" flags and marks the buffer stale; the next `update_hp_grads`
  zeroes just the accumulators of parameters that get no gradient in it, so every accumulator
  reads as DeepSpeed's would before anything else reads it (reduction, norm, clip, step).
  Should a reduction or step come with no `update_hp_grads` since the clear, the whole buffer
  is zeroed first (`zero_if_stale`). The alignment padding at the buffer's end
  is never written with anything but +0.0 (the reduction sums zeros, the clip and the norm see
  only the parameters' ranges), so it stays zero. Between a step and the next backward the
  buffer still holds the last step's gradients where DeepSpeed's held zeros (nothing in ds3d
  or DeepSpeed's training path reads it then).
* the gradient norm: DeepSpeed calls `t.detach().float().norm(2)` and `.to(device)` per tensor
  (~300 launches) and masks a non-finite norm with a tensor it creates from a host scalar (a
  host-to-device copy in the middle of the step). Here one `torch._foreach_norm` over all the
  tensors, the same stack/pow/sum/all-reduce/pow, and the mask filled with the scalar -1.0
  itself. On CPU `_foreach_norm` runs `linalg.vector_norm` (what `Tensor.norm(2)` dispatches
  to) per tensor: the same bits, tested. On CUDA it is one multi-tensor kernel that sums each
  tensor's squares in another order than `vector_norm`'s reduction, so the norm, and through
  the clip coefficient the clipped gradients and weights, may differ from DeepSpeed's in the
  last bits (the GPU step is not bitwise deterministic run to run anyway, docs/performance.md).
  A NaN or Inf gradient still gives a non-finite per-tensor norm, hence the -1.0 mask and the
  skipped step, as before (tested).
* clipping tests `max_norm / (norm + eps) < 1` on a GPU tensor (a host sync), then launches one
  multiply per parameter. Here one foreach multiply by min(coefficient, 1) (clipped gradients
  get the same product, unclipped ones are multiplied by exactly 1.0), launched before the
  step's one host sync (its non-finite-norm check): the GPU has it queued while the host waits.
  A non-finite norm discards the gradients right after (`clear_hp_grads`), as in DeepSpeed,
  so the early multiply leaves no trace.

* AdamW's step, on CUDA (trainer/fused_adamw.py): the clip's multiply, torch's AdamW update
  and `update_lp_params`' copy of the fp32 weights into the bf16 partition are one Triton pass
  over the flat partitions instead of three (the clip coefficient is applied as the kernel reads
  each gradient, so the gradient buffer keeps the unclipped values; nothing reads it before the
  next `clear_hp_grads`). Its weights may differ from torch's AdamW kernel in the last bits, like
  the norm above. Only a first step (the moments do not exist yet), SGD or other optimizers,
  and the CPU keep torch's step.

* the data-parallel gradient reduction, when it is an identity (`reduction_is_identity`): at
  DP 1 without gradient accumulation DeepSpeed still converts the fp32 gradient buffers to bf16
  and back (two full passes over them) around an all-reduce of one rank.

`install()` is idempotent and applies to DeepSpeed 0.19 only (the version these were checked
against in tests/unit/test_bf16_fastpath.py), for BF16_Optimizer configurations without MoE,
Muon or immediate_grad_update (those keep DeepSpeed's code); DS3D_DEEPSPEED_BF16=stock keeps
DeepSpeed's own everywhere (for A/B runs).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import fused_adamw


def install() -> None:
    import deepspeed
    from deepspeed.runtime import bf16_optimizer

    cls = bf16_optimizer.BF16_Optimizer
    if getattr(cls.update_hp_grads, "ds3d_fast", False) or \
            os.environ.get("DS3D_DEEPSPEED_BF16") == "stock" or \
            not deepspeed.__version__.startswith("0.19."):
        return
    stock_update = cls.update_hp_grads
    stock_step = cls.step
    stock_clear = cls.clear_hp_grads
    stock_clip = bf16_optimizer.clip_tensors_by_global_norm

    @torch.no_grad()
    def update_hp_grads(self: Any, clear_lp_grads: bool = False) -> None:
        if not copies_first_gradients(self):
            zero_if_stale(self)
            self._ds3d_bf16_exact = False
            return stock_update(self, clear_lp_grads)
        first = not any(any(has) for has in self.fp32_groups_has_gradients)
        exact = first or getattr(self, "_ds3d_bf16_exact", False)
        stale = getattr(self, "_ds3d_stale", False)  # only right after clear_hp_grads
        fresh_hp: list[torch.Tensor] = []
        fresh_lp: list[torch.Tensor] = []
        unwritten: list[torch.Tensor] = []
        for i, group in enumerate(self.bf16_groups):
            hp_grads, has = self.fp32_groups_gradients[i], self.fp32_groups_has_gradients[i]
            for j, lp in enumerate(group):
                if lp.grad is None:
                    if stale:  # no gradient now: must read as zero, as DeepSpeed's would
                        unwritten.append(hp_grads[j].data)
                    continue
                hp = hp_grads[j]
                grad = lp.grad.data.view(hp.shape)
                if has[j]:  # a later micro-batch of this step: accumulate
                    hp.data.add_(grad)
                    exact = False
                else:  # the accumulator is zero (clear_hp_grads): 0 + g == g
                    fresh_hp.append(hp.data)
                    fresh_lp.append(grad)
                    exact = exact and grad.dtype == torch.bfloat16
                lp._hp_grad = hp
                has[j] = True
        if unwritten:
            torch._foreach_zero_(unwritten)
        if fresh_hp:
            torch._foreach_copy_(fresh_hp, fresh_lp)
        self._ds3d_stale = False
        self._ds3d_bf16_exact = exact  # every accumulator holds a bf16 value (or zero)
        if clear_lp_grads:
            for group in self.bf16_groups:
                for lp in group:
                    if lp.grad is not None:
                        lp.grad.zero_()
        return None

    def clear_hp_grads(self: Any) -> None:
        """Forget the step's gradients without zeroing them: update_hp_grads overwrites or
        zeroes each accumulator before it is read again (module docstring)."""
        if not copies_first_gradients(self):
            stock_clear(self)
            self._ds3d_stale = False
            return
        for i, group in enumerate(self.fp32_groups_gradients):
            self.fp32_groups_has_gradients[i] = [False] * len(group)
        self._ds3d_stale = True

    def clip(input_tensors: Any, max_norm: float = 1.0, global_norm: Any = None, mpu: Any = None,
             eps: float = 1e-6) -> Any:
        tensors = [t.detach() for t in input_tensors]
        if not torch.is_tensor(global_norm) or not tensors:
            return stock_clip(input_tensors, max_norm, global_norm, mpu, eps)
        coef = clip_coefficient(global_norm, max_norm, eps)
        for dtype in {t.dtype for t in tensors}:
            torch._foreach_mul_([t for t in tensors if t.dtype == dtype], coef.to(dtype))
        return global_norm

    @torch.no_grad()
    def step(self: Any, closure: Any = None) -> None:
        """BF16_Optimizer.step of DeepSpeed 0.19.8 for the dense case, with the norm and the clip
        above; every line else as DeepSpeed's."""
        zero_if_stale(self)  # a step with no backward since the last one
        if closure is not None or self.has_moe_layers or self._uses_muon or \
                float(self.norm_type) != 2.0:
            return stock_step(self, closure)
        self.overflow = False
        grads, _ = self.get_grads_for_norm()
        norm = global_norm_2(grads, self.mpu)
        self._global_grad_norm = norm
        fused = fused_adamw.partitions(self)  # AdamW + clip + bf16 copy in one pass
        coef = None
        if self.clip_grad > 0. and fused is not None:
            coef = clip_coefficient(norm, self.clip_grad)
        elif self.clip_grad > 0.:  # queued before the host sync below
            clip(self.get_grads_for_norm(for_clipping=True), max_norm=self.clip_grad,
                 global_norm=norm, mpu=self.mpu)
        if bf16_optimizer.is_invalid_grad_norm(norm):
            self.overflow = True
            self._global_grad_norm = float("inf")
            self.clear_hp_grads()
            self.clear_lp_grads()
            return None
        if fused is not None:
            fused_adamw.step_(fused, coef)
            self.optimizer._opt_called = True  # as torch's step marks it for the LR scheduler
            self._lazy_init_hp_params_optimizer_state()
            bf16_optimizer.all_gather_dp_groups(
                groups_flat=self.bf16_groups_flat,
                partitioned_param_groups=self.bf16_partitioned_groups,
                dp_process_group=self.real_dp_process_group,
                start_alignment_factor=self.nccl_start_alignment_factor,
                allgather_bucket_size=self.allgather_bucket_size)  # update_lp_params' second half
            self.clear_hp_grads()
            return None
        for param_partition, grad_partition in zip(self.fp32_groups_flat_partition,
                                                   self.fp32_groups_gradient_flat_partition,
                                                   strict=True):
            param_partition.grad = grad_partition.to(param_partition.dtype) \
                if grad_partition.dtype != param_partition.dtype else grad_partition
        self.optimizer.step()
        if self.grad_acc_dtype is not torch.float32:
            for param_partition in self.fp32_groups_flat_partition:
                param_partition.grad = None
        self._lazy_init_hp_params_optimizer_state()
        self.update_lp_params()
        self.clear_hp_grads()
        return None

    from deepspeed.runtime.engine import DeepSpeedEngine

    stock_reduce = DeepSpeedEngine.buffered_allreduce_fallback

    def buffered_allreduce_fallback(self: Any, grads: Any = None,
                                    elements_per_buffer: int = 500000000) -> None:
        if grads is None:
            zero_if_stale(self.optimizer)  # a reduction with no backward since the last step
            if reduction_is_identity(self, cls):
                return None
        return stock_reduce(self, grads, elements_per_buffer)

    update_hp_grads.ds3d_fast = True  # type: ignore[attr-defined]
    cls.update_hp_grads = update_hp_grads
    cls.clear_hp_grads = clear_hp_grads
    cls.step = step
    bf16_optimizer.clip_tensors_by_global_norm = clip
    DeepSpeedEngine.buffered_allreduce_fallback = buffered_allreduce_fallback


def clip_coefficient(global_norm: torch.Tensor, max_norm: float,
                     eps: float = 1e-6) -> torch.Tensor:
    """DeepSpeed 0.19's clip_tensors_by_global_norm factor (eps its default), at most 1: the
    gradients are multiplied by it every step (by exactly 1.0 when the norm is under max_norm)."""
    return torch.clamp(max_norm / (global_norm + eps), max=1.0)


def copies_first_gradients(opt: Any) -> bool:
    """Whether ds3d's update_hp_grads runs for this BF16_Optimizer: not with DeepSpeed's
    per-parameter hooks (immediate_grad_update) or AutoEP's folding correction, whose adds need
    a truly zeroed buffer (their clear_hp_grads stays DeepSpeed's)."""
    return not opt.immediate_grad_update and \
        getattr(opt, "autoep_folding_tp_group", None) is None


def zero_if_stale(opt: Any) -> None:
    """Zero the whole fp32 gradient buffer if it was cleared lazily and no update_hp_grads has
    run since (then no accumulator holds this step's gradient): DeepSpeed's clear_hp_grads."""
    if getattr(opt, "_ds3d_stale", False):
        for flat in opt.fp32_groups_gradients_flat:
            flat.zero_()
        opt._ds3d_stale = False


def reduction_is_identity(engine: Any, bf16_cls: type) -> bool:
    """DeepSpeed 0.19's gradient reduction for BF16_Optimizer (`buffered_allreduce_fallback` ->
    `allreduce_bucket`) converts the fp32 gradient buffers to the communication dtype, all-reduces
    them over the data-parallel group and converts them back, at every DP size. It changes no
    bit when that group is this rank alone, the gradients are bf16 values already (one
    micro-batch per step, none accumulated in fp32: `_ds3d_bf16_exact`), the communication dtype
    holds every bf16 value (bf16, fp32), no tied-weight all-reduce summed into the buffers
    first, and no pre/post-division factor other than 1 multiplies them. Then the two full
    passes over the buffers (~6 ms a step of the 1.4B model on the H200) are skipped."""
    from deepspeed import comm as dist
    from deepspeed.utils import groups

    opt = engine.optimizer
    if not isinstance(opt, bf16_cls) or not getattr(opt, "_ds3d_bf16_exact", False) or \
            engine.has_moe_layers or engine.gradient_predivide_factor() != 1.0 or \
            engine.communication_data_type not in (torch.bfloat16, torch.float32):
        return False
    if engine.pipeline_parallelism:
        dp_group = engine.mpu.get_data_parallel_group()
        tied = engine.module.get_tied_weights_and_groups()
        if any(dist.get_world_size(group=group) != 1 for _, group in tied):
            return False
    else:
        dp_group = groups._get_sequence_data_parallel_group()
    return bool(dist.get_world_size(group=dp_group) == 1)


def global_norm_2(tensors: list[torch.Tensor], mpu: Any) -> torch.Tensor:
    """deepspeed.runtime.utils.get_global_norm_of_tensors(tensors, norm_type=2, mpu=mpu) of
    DeepSpeed 0.19.8 (no MoE group) with the per-tensor norms from one `torch._foreach_norm`:
    bit for bit DeepSpeed's on CPU (there it runs `linalg.vector_norm` per tensor); on CUDA one
    launch instead of one a tensor, summing in another order (module docstring). A non-finite
    gradient gives a non-finite total, returned as -1.0 as DeepSpeed's does."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    norms = torch._foreach_norm([t.detach().float() for t in tensors], 2.0)
    total = torch.stack([n if n.device == device else n.to(device) for n in norms]).pow(2.0).sum()
    if mpu is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    total = total.to(tensors[0].device).pow(1. / 2.0)
    return total.masked_fill_(total.isnan().logical_or(total.isinf()), -1.0)
