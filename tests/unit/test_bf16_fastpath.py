"""ds3d's replacements in DeepSpeed's BF16_Optimizer (trainer/bf16_fastpath.py) train exactly
like DeepSpeed's own: a real BF16_Optimizer (one gloo rank) stepped with the stock code and with
the replacements, from the same weights and data, ends with identical weights, optimizer
moments and gradient norms, bit for bit, for SGD (which unlike Adam sees the clip's scale) and
AdamW, clipping every step and never, one micro-batch per step and two (the first converted
into the zeroed accumulator, the second added). Some gradients are exact zeros of sign minus:
the one place where the replacement's accumulator differs in bits (-0.0 kept, where
DeepSpeed's 0.0 + -0.0 stores +0.0), checked to change nothing after it. With one micro-batch
the data-parallel reduction of one rank (a bf16 round trip of bf16 values) is skipped: counted.

The replacement clears the fp32 gradient buffer without zeroing it (a step's first gradients
overwrite it): a bias that gets no gradient in some micro-batches and in whole steps (one of
them right after a step in which its gradient was NaN) checks that the accumulators of
parameters without a gradient still read as DeepSpeed's zeros, through AdamW's weight decay
and moments. A NaN (copied into a zeroed accumulator) and an Inf (added to one) gradient
element check that the one-launch gradient norm still skips the step, as DeepSpeed's does;
on CPU that norm is bit for bit DeepSpeed's per-tensor one, which the norms compared show."""

import math
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys, socket, torch, deepspeed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    from ds3d.trainer import bf16_fastpath

    def bits(t):
        return t.detach().float().view(torch.int32).flatten().tolist()

    STEPS = 8
    inject = {"param": None, "value": None}  # one gradient element to overwrite, and with what

    def injected(param):
        def hook(grad):
            if inject["param"] is not param:
                return grad
            grad = grad.clone()
            grad.view(-1)[0] = inject["value"]
            return grad
        param.register_hook(hook)

    def bias_used(step, micro, gas):
        # steps 2 and 5 none (5 after the NaN in it), 1 only the first micro-batch, 3 the last
        return {1: micro == 0, 2: False, 3: micro == gas - 1, 5: False}.get(step, True)

    def injection(step, micro, gas, model):
        # step 4: NaN in the bias's first micro-batch gradient (converted into its zeroed
        # accumulator); step 6: Inf in the first linear's last one (added at gas 2)
        if step == 4 and micro == 0:
            return model[0].bias, float("nan")
        if step == 6 and micro == gas - 1:
            return model[1].weight, float("inf")
        return None, None

    class SignedZeroGrads(torch.nn.Module):
        # x + p * mask, mask -0.0 in its first columns: there d(loss)/dp = -0.0 * d(loss)/dy
        # elementwise (no sum over a batch, which would start at +0.0), -0.0 where that is > 0
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.randn(2, 16))
            self.bias = torch.nn.Parameter(torch.randn(16))  # used only when use_bias
            self.use_bias = True
            self.register_buffer("mask", torch.cat([torch.full((2, 3), -0.0),
                                                    torch.ones(2, 13)], dim=1))

        def forward(self, x):
            x = x + self.p * self.mask
            return x + self.bias if self.use_bias else x

    def train(clip, opt_name, gas):
        torch.manual_seed(0)
        model = torch.nn.Sequential(SignedZeroGrads(), torch.nn.Linear(16, 32),
                                    torch.nn.GELU(), torch.nn.Linear(32, 4)).to(torch.bfloat16)
        cfg = {"train_batch_size": 2 * gas, "train_micro_batch_size_per_gpu": 2,
               "gradient_accumulation_steps": gas,
               "gradient_clipping": clip, "bf16": {"enabled": True},
               "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
               "data_types": {"grad_accum_dtype": "fp32"}}
        opt = (torch.optim.SGD(model.parameters(), lr=0.5) if opt_name == "sgd" else
               torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1))
        eng, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=opt)
        assert type(eng.optimizer).__name__ == "BF16_Optimizer"
        injected(model[0].bias)
        injected(model[1].weight)
        norms, grads, applied = [], [], []
        for step in range(STEPS):
            for micro in range(gas):
                g = torch.Generator().manual_seed(10 * step + micro)
                x = torch.randn(2, 16, generator=g)
                model[0].use_bias = bias_used(step, micro, gas)
                inject["param"], inject["value"] = injection(step, micro, gas, model)
                eng.backward(eng(x.bfloat16()).float().pow(2).mean())
                if micro == gas - 1:
                    grads.append([bits(t) for t in eng.optimizer.fp32_groups_gradients_flat])
                eng.step()
            norms.append(float(eng.get_global_grad_norm()))
            applied.append(eng.was_step_applied())
        state = [bits(v) for s in eng.optimizer.optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.numel() > 1]
        return [bits(p) for p in model.parameters()], state, norms, grads, applied

    if sys.argv[1] == "fast":
        bf16_fastpath.install()
    from deepspeed.runtime.engine import DeepSpeedEngine
    reductions = [0]  # DeepSpeed's fp32 -> bf16 -> all-reduce -> fp32 passes over the buffers
    stock_bucket = DeepSpeedEngine.allreduce_bucket

    def counted_bucket(*args, **kwargs):
        reductions[0] += 1
        return stock_bucket(*args, **kwargs)

    DeepSpeedEngine.allreduce_bucket = counted_bucket
    from deepspeed.runtime import bf16_optimizer
    assert hasattr(bf16_optimizer.BF16_Optimizer.update_hp_grads, "ds3d_fast") == (
        sys.argv[1] == "fast")
    out = {}
    for opt_name in ("sgd", "adamw"):
        for gas in (1, 2):
            for clip in (1e-3, 1e6):  # clipping every step / never
                reductions[0] = 0
                out[f"{opt_name} gas={gas} clip={clip}"] = train(clip, opt_name, gas)
                out[f"reductions {opt_name} gas={gas} clip={clip}"] = reductions[0]
    print("RESULT", repr(out))
""")

NEG_ZERO, POS_ZERO = -2**31, 0  # float32 bit patterns of -0.0 and +0.0 as int32


def _is_nan(bits: int) -> bool:
    """Whether a float32 bit pattern (as int32) is a NaN: all exponent bits, some mantissa."""
    return bits & 0x7F800000 == 0x7F800000 and bits & 0x007FFFFF != 0


def _run(mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                       timeout=170)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-3000:]
    # our own script's repr of ints, floats and bools (inf: a skipped step's norm)
    return eval(lines[-1][len("RESULT "):], {"inf": math.inf})  # noqa: S307


@pytest.mark.timeout(400)
def test_fast_bf16_optimizer_paths_train_exactly_like_deepspeeds():
    stock, fast = _run("stock"), _run("fast")
    assert stock.keys() == fast.keys()
    signed_zeros = 0
    for case in [c for c in stock if c.startswith("reductions ")]:
        assert stock[case] > 0, case
        # one rank, bf16 gradients not accumulated in fp32: DeepSpeed's round trip is skipped
        assert (fast[case] == 0) == ("gas=1" in case), (case, fast[case])
        del stock[case], fast[case]
    for case in stock:
        s_weights, s_state, s_norms, s_grads, s_applied = stock[case]
        f_weights, f_state, f_norms, f_grads, f_applied = fast[case]
        assert f_weights == s_weights, case
        assert f_state == s_state, case
        assert f_norms == s_norms, case
        # the NaN (step 4) and the Inf (step 6) gradient: the step skipped, the norm reported inf
        assert f_applied == s_applied == [step not in (4, 6) for step in range(8)], case
        assert [n == float("inf") for n in f_norms] == [not a for a in f_applied], case
        assert len(s_state) == (2 if "adamw" in case else 0), case  # AdamW's two moments
        for s_step, f_step in zip(s_grads, f_grads, strict=True):
            for s_flat, f_flat in zip(s_step, f_step, strict=True):
                for s, f in zip(s_flat, f_flat, strict=True):
                    if s != f and not (_is_nan(s) and _is_nan(f)):  # NaNs: any payload
                        # only the sign of an exact zero may differ
                        assert (s, f) == (POS_ZERO, NEG_ZERO), case
                        signed_zeros += 1
    assert signed_zeros > 0  # the data did produce -0.0 gradients: the claim above was tested
