"""A NaN whose update every rank's optimizer skipped costs one batch, not a rollback
(trainer/loop.py `_undo_skipped_update`): real 4-rank jobs under ds3d's agent, gloo on CPU, a
NaN injected into rank 1's forward at step 5 (control/inject.json, trainer/faults.py).

BF16_Optimizer and DeepSpeed's ZeRO 1/2 optimizer discard the gradients of a step whose global
gradient norm is not finite, so the weights and the optimizer state are still step 4's. The job
goes back to step 4 in place with nothing read from a checkpoint (these jobs save none before
the end, so a rollback would have nothing to go to), skips batch 4, and from there trains bit
for bit as a fault-free job that skipped batch 4 from the start: every later loss, gradient
norm and LR, and every tensor and counter of the final checkpoint (weights, optimizer moments,
DeepSpeed's global_steps / global_samples / skipped_steps, the LR schedule) are the same."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures.bitwise import assert_same
from support import records, torchrun

BASE = ["train.steps=8", "train.warmup_steps=2", "checkpoint.interval=0"]
AT, RANK = 5, 1
LAYOUTS = {  # name: sets; each optimizer skips a non-finite step
    # BF16_Optimizer (fp32 master weights and accumulation), TP 2 x PP 2
    "bf16_tp2_pp2": ['train.precision="bf16"', "parallel.tp=2", "parallel.pp=2"],
    # fp32 under DeepSpeed's ZeRO-1 optimizer, partitioned over DP 2, two micro-batches
    "fp32_zero1_dp2_pp2": ["parallel.dp=2", "parallel.pp=2"],
}


def _inject(run_dir: Path, **req: Any) -> None:
    (run_dir / "control").mkdir(parents=True, exist_ok=True)
    (run_dir / "control" / "inject.json").write_text(json.dumps({"id": 1, **req}))


def _steps(run_dir: Path) -> dict[int, tuple[float, float, float]]:
    """step -> (loss, grad norm, LR) as rank 0 reported it last."""
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in records(run_dir, 0, "step")}


def _checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "store" / "tiny" / "ckpt" / f"step-{step:08d}"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nan_with_a_skipped_update_costs_one_batch_and_equals_a_run_without_it(layout, tmp_path):
    sets = BASE + LAYOUTS[layout]
    ref, run = tmp_path / "ref", tmp_path / "run"
    _inject(run, kind="nan", rank=RANK, at_step=AT)
    torchrun(run, 4, sets=sets)
    first = {}
    for r in records(run, 0, "step"):
        first.setdefault(r["step"], r)
    assert first[AT]["loss"] != first[AT]["loss"] and first[AT]["skipped"], first[AT]
    assert [(f["cause"], f["step"]) for f in records(run, 0, "fault")] == [("nan", AT)]
    [rec] = records(run, 0, "recovery")
    assert rec["source"] == "skipped_update", rec
    assert (rec["recovered_to"], rec["steps_lost"], rec["skipped_batches"]) == (
        AT - 1, 1, [AT - 1, AT]), rec
    # nothing read: no checkpoint was restored (and none existed before the last step)
    phases = {c["phase"] for c in records(run, 0, "checkpoint")}
    assert not phases & {"restoring", "loaded", "rolled_back"}, phases
    assert sorted(p.name for p in (run / "store" / "tiny" / "ckpt").iterdir()) == [
        "step-00000008"]

    torchrun(ref, 4, sets=sets + [f"data.skip_batches=[[{AT - 1}, {AT}]]"])
    assert not records(ref, 0, "fault")
    want, got = _steps(ref), _steps(run)
    assert sorted(got) == list(range(1, 9))
    assert got == want  # loss, gradient norm and LR of every step, exactly
    a, b = _checkpoint(run, 8), _checkpoint(ref, 8)
    manifest = json.loads((a / "MANIFEST.json").read_text())
    assert manifest["data_position"]["skip_batches"] == [[AT - 1, AT]]
    assert manifest["tokens_seen"] == json.loads((b / "MANIFEST.json").read_text())["tokens_seen"]
    files = sorted(p.relative_to(a).as_posix() for p in a.rglob("*.pt"))
    assert files and files == sorted(p.relative_to(b).as_posix() for p in b.rglob("*.pt"))
    for name in files:
        assert_same(torch.load(a / name, weights_only=False),
                     torch.load(b / name, weights_only=False), name)
    states = torch.load(next(a.rglob("mp_rank_00_model_states.pt")), weights_only=False)
    assert (states["global_steps"], states["skipped_steps"]) == (8, 0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nan_rolls_back_when_more_batches_than_the_bad_one_are_to_be_skipped(tmp_path):
    """`faults.skip_batches` = 2 asks to skip a batch that step 5 trained on before the bad one:
    an update that was applied, which only a rollback takes back (here to step 4's save, read
    from its host copy)."""
    run = tmp_path / "run"
    _inject(run, kind="nan", rank=RANK, at_step=6)
    torchrun(run, 4, sets=["train.steps=8", "train.warmup_steps=2", "parallel.tp=2",
                           "parallel.pp=2", "checkpoint.interval=4", "faults.skip_batches=2"])
    [rec] = records(run, 0, "recovery")
    assert rec["source"] == "memory", rec
    assert (rec["recovered_to"], rec["steps_lost"], rec["skipped_batches"]) == (4, 2, [4, 6])
    assert sorted(_steps(run)) == list(range(1, 9))
