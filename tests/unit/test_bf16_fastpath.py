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

import pytest

from fixtures.bf16_runs import run

NEG_ZERO, POS_ZERO = -2**31, 0  # float32 bit patterns of -0.0 and +0.0 as int32


def _is_nan(bits: int) -> bool:
    """Whether a float32 bit pattern (as int32) is a NaN: all exponent bits, some mantissa."""
    return bits & 0x7F800000 == 0x7F800000 and bits & 0x007FFFFF != 0


@pytest.mark.timeout(400)
def test_fast_bf16_optimizer_paths_train_exactly_like_deepspeeds():
    stock, fast = run("stock"), run("fast")
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
