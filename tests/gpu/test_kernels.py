"""The fused Triton kernels (trainer/kernels.py) against their eager references on the GPU,
with fresh random inputs of the shapes ds3d trains (bf16, odd head counts, a vocabulary that is
not a multiple of the block)."""

import pytest
import torch

from ds3d.trainer import kernels

pytestmark = [pytest.mark.gpu]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("b,s,h,hd", [(2, 2048, 16, 128), (3, 100, 12, 64), (1, 7, 1, 16)])
def test_rotary_qkv_matches_the_reference_forward_and_backward(b, s, h, hd):
    qkv = torch.randn(b, s, 3, h, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grads = [torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    fused = kernels.rotary_qkv(qkv, 10000.0)
    ref64 = kernels.rotary_qkv_reference(qkv.detach().double().requires_grad_(), 10000.0)
    for f, r in zip(fused, ref64, strict=True):
        assert f.shape == (b, h, s, hd) and f.is_contiguous()
        assert torch.isfinite(f).all()
        assert _rel(f, r) < 1e-2
    (g_fused,) = torch.autograd.grad(fused, qkv, grads)
    leaf = qkv.detach().double().requires_grad_()
    (g_ref,) = torch.autograd.grad(kernels.rotary_qkv_reference(leaf, 10000.0),
                                   leaf, [g.double() for g in grads])
    assert torch.isfinite(g_fused).all()
    assert _rel(g_fused, g_ref) < 1e-2


@pytest.mark.parametrize("rows,vocab", [(16384, 50304), (33, 5000), (5, 256)])
def test_cross_entropy_matches_fp64_loss_and_gradient(rows, vocab):
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    loss = kernels.cross_entropy_mean(logits, targets)
    (grad,) = torch.autograd.grad(loss * 3.0, logits)
    leaf = logits.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(leaf, targets)
    (grad_ref,) = torch.autograd.grad(ref * 3.0, leaf)
    assert abs(loss.item() - ref.item()) < 1e-4 * ref.item()
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad).all()
    assert _rel(grad, grad_ref) < 1e-2
