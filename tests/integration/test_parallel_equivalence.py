"""The 3D parallelism is real: every layout computes the same training run as one process.

Three things are compared with the single-process run, each able to catch what the others miss:
  * the loss at every step (a wrong shard, a missing all-reduce or a mis-ordered sample changes
    it in the 3rd digit);
  * the global gradient norm at every step (a gradient scaled by a constant, e.g. summed instead
    of averaged over DP or counted twice over TP, leaves AdamW's updates and so the loss almost
    unchanged, but not the norm);
  * every parameter after the last step, consolidated from the committed checkpoint by the export
    path (ds3d.trainer.export), which must equal the single process's weights;
and with TP > 1, each TP rank's checkpoint must hold 1/TP of every weight matrix: a TP layout that
silently ran replicated would pass the three comparisons above.

Tolerance: fp32 on CPU. The layouts differ only in the order of floating-point sums (TP sums
partial matmul products with an all-reduce, DP averages gradients, accumulation adds
micro-batches), so losses and norms agree to ~1e-7 relative; over 5 steps of Adam that error
does not grow past 1e-5 relative for the losses and norms. Weights: an Adam step moves a weight
by about lr = 3e-3 whatever its gradient's size, so where a gradient is near zero (an embedding
row of a token barely seen) its direction is decided by rounding, and a handful of elements
(9 of 180k measured at TP 2) differ by up to ~1.3e-4. So: every weight within WEIGHT_MAX_DIFF
(a third of one step's move), and all but OUTLIERS of each tensor within WEIGHT_ATOL, 300 times
finer than one step. A wrong gradient moves nearly every element past that (see the seed test).
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ds3d.trainer.export import export

from support import records, torchrun

STEPS = 5
BASE = [f"train.steps={STEPS}", "train.micro_batch_size=2", "train.global_batch_size=8",
        "train.warmup_steps=2"]
WEIGHT_ATOL = 1e-5
WEIGHT_MAX_DIFF = 1e-3
OUTLIERS = 1e-3  # share of a tensor's elements allowed past WEIGHT_ATOL


def trained(run: Path, nproc: int, sets: list[str]) -> dict:
    """Trains to STEPS; returns rank 0's loss and gradient norm per step and the final weights
    exported from the committed checkpoint."""
    torchrun(run, nproc, sets=sets)
    steps = {r["step"]: r for r in records(run, 0, "step")}
    assert sorted(steps) == list(range(1, STEPS + 1))
    export(f"file://{run}/store/tiny", run / "export", step=STEPS)
    return {"loss": {s: r["loss"] for s, r in steps.items()},
            "grad_norm": {s: r["grad_norm"] for s, r in steps.items()},
            "weights": load_file(str(run / "export" / "model.safetensors"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("ref"), 1, BASE)


LAYOUTS = {
    "tp2": (2, 1, 1, []),
    "pp2": (1, 2, 1, []),
    "dp2": (1, 1, 2, []),
    "tp2-pp2-dp2": (2, 2, 2, []),
    "pp2-explicit-partition-activation-checkpointing": (
        1, 2, 1, ["parallel.partition_method=[1, 3]", "parallel.activation_checkpoint_interval=1"]),
    "dp2-zero2-plain-engine": (1, 1, 2, ["parallel.zero_stage=2"]),
}


def weight_mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """What breaks the weight rule above, one line per tensor (empty: the weights agree)."""
    bad = [f"tensors {sorted(set(got) ^ set(want))} in one model only"] if set(got) != set(want) \
        else []
    for key in sorted(set(got) & set(want)):
        if got[key].shape != want[key].shape:
            bad.append(f"{key}: shape {tuple(got[key].shape)} != {tuple(want[key].shape)}")
            continue
        diff = (got[key] - want[key]).abs()
        off = int((diff > WEIGHT_ATOL).sum())
        if diff.max() > WEIGHT_MAX_DIFF or off > OUTLIERS * diff.numel():
            bad.append(f"{key}: {off}/{diff.numel()} elements off by > {WEIGHT_ATOL}, "
                       f"max {diff.max():.3g}")
    return bad


def assert_tp_ranks_hold_shards(run: Path, tp: int, full: dict[str, torch.Tensor]) -> None:
    """Every weight matrix of every layer file is 1/TP of the full matrix on each TP rank, and
    the ranks' slices differ (they are not one replicated copy)."""
    tag = run / "ckpt" / f"global_step{STEPS}"
    files = sorted(tag.glob("layer_*-model_00-model_states.pt"))
    assert files, f"no pipeline layer files in {tag}"
    matrices = 0
    for f in files:
        layer = f.name.split("-")[0].removeprefix("layer_").lstrip("0") or "0"
        shards = [torch.load(tag / f.name.replace("model_00", f"model_{r:02d}"),
                             weights_only=False) for r in range(tp)]
        for name, first in shards[0].items():
            if first.dim() < 2:
                continue  # biases and norms: some sharded, some replicated by design
            whole = full[f"{layer}.{name}"]
            for r, shard in enumerate(shards):
                assert shard[name].numel() * tp == whole.numel(), \
                    (f.name, name, r, shard[name].shape, whole.shape)
            assert not torch.equal(shards[0][name], shards[1][name]), (f.name, name)
            matrices += 1
    assert matrices >= 4, "the embedding, attention, MLP and head matrices were all found"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    tp, pp, dp, extra = LAYOUTS[name]
    sets = BASE + [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}"] + extra
    got = trained(tmp_path, tp * pp * dp, sets)
    for step in range(1, STEPS + 1):
        assert got["loss"][step] == pytest.approx(reference["loss"][step], rel=1e-5, abs=0), \
            (name, step, got["loss"], reference["loss"])
        assert got["grad_norm"][step] == pytest.approx(reference["grad_norm"][step], rel=1e-5,
                                                       abs=0), (name, step, got["grad_norm"],
                                                                reference["grad_norm"])
    assert not weight_mismatches(got["weights"], reference["weights"]), \
        (name, weight_mismatches(got["weights"], reference["weights"]))
    if tp > 1:
        assert_tp_ranks_hold_shards(tmp_path, tp, reference["weights"])


def test_the_comparisons_can_fail(tmp_path_factory, reference):
    """A different seed gives other losses, norms and weights, and training moved every weight
    matrix by far more than the tolerance: equality above is neither constant nor trivial."""
    run = tmp_path_factory.mktemp("seed")
    other = trained(run, 1, BASE + ["train.seed=99"])
    assert other["loss"][1] != pytest.approx(reference["loss"][1], rel=1e-4)
    assert other["grad_norm"][1] != pytest.approx(reference["grad_norm"][1], rel=1e-4)
    assert reference["loss"][STEPS] < reference["loss"][1]  # the run learns something
    assert all(n > 0 for n in reference["grad_norm"].values())
    broken = weight_mismatches(other["weights"], reference["weights"])
    matrices = [k for k, t in reference["weights"].items() if t.dim() >= 2]
    assert all(any(line.startswith(f"{k}:") for line in broken) for k in matrices), broken
