"""trainer/fused_adamw.py's kernel against what it replaces, on CUDA: DeepSpeed's clip multiply,
torch's AdamW step (its fused kernel, whose step count lives on the GPU, and its foreach one,
whose count is on the host) and the copy of the fp32 weights into their bf16 partition, over
several steps, with sizes that are not a multiple of the kernel's block."""

import pytest

pytestmark = [pytest.mark.gpu]

torch = pytest.importorskip("torch")


def _partitions(n: int, fused: bool, seed: int):
    from ds3d.trainer.fused_adamw import Partition

    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = torch.randn(n, device="cuda", generator=gen)
    ref_weight = weight.clone()
    opt = torch.optim.AdamW([ref_weight], lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=fused, foreach=None if fused else True)
    ours = torch.optim.AdamW([weight], lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.1, fused=fused, foreach=None if fused else True)
    grad = torch.randn(n, device="cuda", generator=gen)
    # a first torch step creates the moments in both (as BF16_Optimizer's first step does)
    for w, o in ((ref_weight, opt), (weight, ours)):
        w.grad = grad.clone()
        o.step()
    part = Partition(weight, torch.empty_like(weight), torch.empty(n, device="cuda",
                                                                   dtype=torch.bfloat16),
                     ours.state[weight], ours.param_groups[0])
    return part, ref_weight, opt, gen


@pytest.mark.parametrize("fused", [True, False], ids=["step-on-gpu", "step-on-host"])
@pytest.mark.parametrize("n", [1, 2047, 2049, 3 * 2048 + 5, 1 << 20])
def test_matches_clip_then_torch_adamw_then_bf16_copy(fused: bool, n: int):
    from ds3d.trainer import fused_adamw

    part, ref_weight, opt, gen = _partitions(n, fused, seed=n)
    for step in range(6):
        g = torch.randn(n, device="cuda", generator=gen) * (10.0 if step % 2 else 0.01)
        # clipped to norm 1 (the large gradients: coef < 1; the small: exactly 1.0), and once
        # with no clip at all
        coef = torch.clamp(1.0 / (g.norm() + 1e-6), max=1.0) if step != 3 else None
        ref_weight.grad = g * coef if coef is not None else g.clone()
        opt.step()
        part.grad.copy_(g)
        fused_adamw.step_([part], coef)
        torch.cuda.synchronize()
        ref_state = opt.state[ref_weight]
        assert float(part.state["step"]) == float(ref_state["step"]) == step + 2
        # fp32 rounding apart (another compiler's contractions): within a few ulps of each
        # tensor's largest value (an element summed from two terms of opposite sign can be
        # small, its error is the terms')
        for ours, ref in ((part.weight, ref_weight),
                          (part.state["exp_avg"], ref_state["exp_avg"]),
                          (part.state["exp_avg_sq"], ref_state["exp_avg_sq"])):
            torch.testing.assert_close(ours, ref, rtol=2e-6,
                                       atol=4e-7 * float(ref.abs().max()))
        # the bf16 copy is the updated fp32 weight rounded, as update_lp_params' copy_ does
        assert torch.equal(part.weight_lp, part.weight.to(torch.bfloat16))
        assert torch.equal(part.grad, g)  # the gradient buffer keeps its unclipped values
