"""Two hot spots of DeepSpeed's BF16_Optimizer (0.19, used for bf16 with ZeRO 0/1), replaced by
the same arithmetic with fewer memory passes and no host sync. Profiled on an H200 with the
1.4B model (docs/performance.md), DeepSpeed's per-parameter optimizer work took ~30 ms a step
against ~6 ms for a plain fused-AdamW loop.

* `update_hp_grads` adds each bf16 gradient into its fp32 accumulator as
  `hp.add_(lp.grad.to(fp32))`: a converting copy (a full fp32 temporary, written and read again)
  then the add. Here `hp.add_(lp.grad)`: one kernel that converts while it adds; the bf16 -> fp32
  conversion is exact, so the sums are bit-identical.
* gradient clipping tests `max_norm / (norm + eps) < 1` on a GPU tensor (a host sync in the middle
  of the step), then launches one multiply per parameter. Here one foreach multiply by
  min(coefficient, 1): clipped gradients get the same product, unclipped ones are multiplied by
  exactly 1.0.

`install()` is idempotent and applies to DeepSpeed 0.19 only (the version these were checked
against, bit for bit, in tests/unit/test_bf16_fastpath.py); DS3D_DEEPSPEED_BF16=stock keeps
DeepSpeed's own (for A/B runs). Measured gain on the H200 (same run, docs/performance.md): 1.3%
of the eager step, 0.4% compiled, within the run-to-run spread.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def install() -> None:
    import deepspeed
    from deepspeed.runtime import bf16_optimizer

    cls = bf16_optimizer.BF16_Optimizer
    if getattr(cls.update_hp_grads, "ds3d_fast", False) or \
            os.environ.get("DS3D_DEEPSPEED_BF16") == "stock" or \
            not deepspeed.__version__.startswith("0.19."):
        return
    stock_update = cls.update_hp_grads
    stock_clip = bf16_optimizer.clip_tensors_by_global_norm

    def update_hp_grads(self: Any, clear_lp_grads: bool = False) -> None:
        if self.immediate_grad_update or getattr(self, "autoep_folding_tp_group", None) is not None:
            return stock_update(self, clear_lp_grads)
        for i, group in enumerate(self.bf16_groups):
            for j, lp in enumerate(group):
                if lp.grad is None:
                    continue
                hp = self.fp32_groups_gradients[i][j]
                hp.data.add_(lp.grad.data.view(hp.shape))
                lp._hp_grad = hp
                self.fp32_groups_has_gradients[i][j] = True
                if clear_lp_grads:
                    lp.grad.zero_()
        return None

    def clip(input_tensors: Any, max_norm: float = 1.0, global_norm: Any = None, mpu: Any = None,
             eps: float = 1e-6) -> Any:
        tensors = [t.detach() for t in input_tensors]
        if not torch.is_tensor(global_norm) or not tensors:
            return stock_clip(input_tensors, max_norm, global_norm, mpu, eps)
        coef = torch.clamp(max_norm / (global_norm + eps), max=1.0)
        for dtype in {t.dtype for t in tensors}:
            torch._foreach_mul_([t for t in tensors if t.dtype == dtype], coef.to(dtype))
        return global_norm

    update_hp_grads.ds3d_fast = True  # type: ignore[attr-defined]
    cls.update_hp_grads = update_hp_grads
    bf16_optimizer.clip_tensors_by_global_norm = clip
