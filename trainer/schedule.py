"""Learning-rate schedule: linear warm-up, then cosine decay to `min_lr_ratio * lr`.

A callable object (not a lambda) so that torch's LambdaLR can save and restore it inside
DeepSpeed's checkpoint; the first step already trains at lr / warmup_steps (DeepSpeed's
WarmupCosineLR spends its first step at lr = 0).
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine:
    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float) -> None:
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, total_steps, min_ratio

    def __call__(self, step: int) -> float:
        """Multiplier of the base LR for optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float):
    """A factory DeepSpeed calls with its (possibly wrapped) optimizer."""

    def build(optimizer: torch.optim.Optimizer) -> LambdaLR:
        return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_ratio))

    return build
