"""The fused cross-entropy's backward (trainer/kernels.py) skips its multiply by the loss's
gradient when that is exactly 1: the result must be `grad.mul_(grad_out)` bit for bit in both
cases, subnormal, signed-zero and NaN entries included."""

import pytest
import torch

from ds3d.trainer.kernels import scale_by_loss_grad_


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3, 3.0e-5, -1.0])
def test_skipping_the_multiply_by_one_is_exactly_mul(dtype, scale):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 10
    x[:64] = torch.logspace(-44, -30, 64) * torch.sign(x[:64])
    x[64], x[65], x[66] = -0.0, 0.0, float("nan")
    x = x.to(dtype)
    s = torch.tensor(scale)
    ints = {2: torch.int16, 4: torch.int32}[x.element_size()]
    ref = x.clone().mul_(s)
    out = scale_by_loss_grad_(x.clone(), s)
    assert torch.equal(out.view(ints), ref.view(ints))
    assert (out.view(ints) == x.view(ints)).all() == (scale == 1.0)
