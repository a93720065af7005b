"""The 3D parallelism is real: every layout computes the same training run as one process.

Tolerance: fp32 on CPU. The layouts differ only in the order of floating-point sums (TP sums
partial matmul products with an all-reduce, DP averages gradients, accumulation adds
micro-batches), so per-step losses agree to ~1e-7 relative; over 5 steps of Adam that error does
not grow past 1e-5 relative, which is the bound asserted. A wrong shard, a missing all-reduce or
a mis-ordered sample changes the loss in the 3rd digit.
"""

import pytest

from support import losses, torchrun

STEPS = 5
BASE = [f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=8",
        "train.warmup_steps=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref")
    torchrun(run, 1, sets=BASE)
    return losses(run)


LAYOUTS = {
    "tp2": (2, 1, 1, []),
    "pp2": (1, 2, 1, []),
    "dp2": (1, 1, 2, []),
    "tp2-pp2-dp2": (2, 2, 2, []),
    "pp2-explicit-partition-activation-checkpointing": (
        1, 2, 1, ["parallel.partition_method=[1, 3]", "parallel.activation_checkpoint_interval=1"]),
    "dp2-zero2-plain-engine": (1, 1, 2, ["parallel.zero_stage=2"]),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    tp, pp, dp, extra = LAYOUTS[name]
    sets = BASE + [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}"] + extra
    torchrun(tmp_path, tp * pp * dp, sets=sets)
    got = losses(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=0), (name, step, got, reference)
    # the run must actually learn something, or equality would be cheap
    assert reference[STEPS] < reference[1]


def test_reference_is_not_layout_blind(tmp_path_factory, reference):
    """A different seed gives different losses: equality above is not a constant."""
    run = tmp_path_factory.mktemp("seed")
    torchrun(run, 1, sets=BASE + ["train.seed=99"])
    assert losses(run)[1] != pytest.approx(reference[1], rel=1e-4)
