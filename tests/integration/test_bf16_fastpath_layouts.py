"""ds3d's BF16_Optimizer paths (trainer/bf16_fastpath.py) train like DeepSpeed's own in 3D
layouts: real bf16 jobs of 4 ranks under ds3d's agent, once with DeepSpeed's code
(DS3D_DEEPSPEED_BF16=stock) and once with ds3d's, report the same loss and the same global
gradient norm at every step, to the last bit. The layouts cover what the replacements touch:
the pipeline engine's per-stage gradient updates and step, accumulation over micro-batches,
the data-parallel reduction (run at DP 2, skipped as an identity at DP 1) and the norm's
all-reduce over tensor- and pipeline-parallel ranks. (CPU bf16: the ops are the GPU's, the
kernels are not; tests/unit/test_bf16_fastpath.py compares weights and moments bit for bit.)"""

from pathlib import Path

import pytest

from support import records, torchrun

LAYOUTS = {  # name: (sets, what it exercises)
    "dp2_pp2_gas2": ["parallel.dp=2", "parallel.pp=2", "train.global_batch_size=8"],
    "dp2_tp2_gas1": ["parallel.dp=2", "parallel.tp=2", "train.global_batch_size=4"],
    "tp2_pp2_dp1_gas1": ["parallel.tp=2", "parallel.pp=2", "train.global_batch_size=2"],
}
BASE = ['train.precision="bf16"', "train.steps=4", "train.micro_batch_size=2",
        "train.grad_clip=0.05", "checkpoint.interval=0"]


def _trained(run: Path, sets: list[str], stock: bool) -> list[tuple[int, float, float]]:
    torchrun(run, 4, sets=BASE + sets, env={"DS3D_DEEPSPEED_BF16": "stock"} if stock else {})
    steps = [(r["step"], r["loss"], r["grad_norm"]) for r in records(run, 0, "step")]
    assert [s for s, _, _ in steps] == [1, 2, 3, 4]
    return steps


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_exactly_like_deepspeeds_bf16_optimizer(name, tmp_path):
    stock = _trained(tmp_path / "stock", LAYOUTS[name], stock=True)
    fast = _trained(tmp_path / "fast", LAYOUTS[name], stock=False)
    assert fast == stock
    assert len({norm for _, _, norm in stock}) == 4  # the norms moved: a real comparison
