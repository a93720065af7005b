"""Weights out of a 3D checkpoint: export from a (TP, PP, DP) = (2, 2, 1) job, load into the
plain single-process PyTorch model, and get the parallel job's numbers on the same batch."""

import json

import pytest
import torch

from ds3d.checkpoints.export import export, load_exported
from ds3d.trainer.config import build_job_config
from ds3d.trainer.data import BatchPlan
from support import losses, torchrun

SETS = ["train.steps=6", "train.warmup_steps=2", "parallel.tp=2", "parallel.pp=2"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_of_a_tp2_pp2_checkpoint_reproduces_the_parallel_model(tmp_path):
    run = tmp_path / "run"
    torchrun(run, 4, sets=SETS, extra=["--stop-at-step", "4"])
    torchrun(run, 4, sets=SETS)  # continues: its step 5 is computed with step 4's weights
    parallel_loss = losses(run)[5]

    out = tmp_path / "export"
    cfg = export(f"file://{run}/store/tiny", out, step=4)
    assert cfg["step"] == 4 and cfg["source_layout"]["tp"] == 2 and cfg["source_layout"]["pp"] == 2
    assert json.loads((out / "config.json").read_text())["architecture"] == "ds3d-gpt"
    job = build_job_config("tiny", SETS)
    assert cfg["parameters"] == job.model.n_params()

    model = load_exported(out)  # plain PyTorch: no DeepSpeed, no process group
    assert not any(p.is_meta for p in model.parameters())
    plan = BatchPlan(job, dp=1, dp_rank=0)
    with torch.no_grad():
        micro = [model(torch.from_numpy(x), torch.from_numpy(y)).item()
                 for x, y in plan.step_iterator(4)]
        x, _ = next(plan.step_iterator(4))
        logits = model.get_submodule("5")(model.get_submodule("4")(model.get_submodule("3")(
            model.get_submodule("2")(model.get_submodule("1")(model.get_submodule("0")(
                torch.from_numpy(x)))))))
    assert logits.shape == (2, 64, 256)  # full vocabulary: the TP shards were joined
    # fp32; the parallel job summed TP partial products in another order
    assert sum(micro) / len(micro) == pytest.approx(parallel_loss, rel=1e-5, abs=0)


def test_export_refuses_a_missing_step(tmp_path):
    from ds3d.trainer.errors import CheckpointError

    (tmp_path / "store").mkdir()
    with pytest.raises(CheckpointError, match="no complete, verified checkpoint of step 7"):
        export(f"file://{tmp_path}/store", tmp_path / "out", step=7)
