"""Weights out of a 3D checkpoint: export from a (TP, PP, DP) = (2, 2, 1) job, load into the
plain single-process PyTorch model, and get the parallel job's numbers on the same batch."""

import json

import pytest
import torch

from ds3d.trainer.config import build_job_config
from ds3d.trainer.data import BatchPlan
from ds3d.trainer.export import export, load_exported

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
        export(f"file://{tmp_path}/store", tmp_path / "exports" / "out", step=7)
    assert not (tmp_path / "exports").exists()  # the folders made for it are gone again
    (tmp_path / "mine").mkdir()
    with pytest.raises(CheckpointError, match="no complete, verified checkpoint of step 7"):
        export(f"file://{tmp_path}/store", tmp_path / "mine", step=7)
    assert (tmp_path / "mine").is_dir()  # a folder that was there stays


def _fp32_by_deepspeed(local_dir):
    """DeepSpeed's own consolidation, told no tag: it reads the `latest` ds3d wrote."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(local_dir))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_of_a_pp1_zero2_checkpoint_reproduces_the_job(tmp_path):
    """PP = 1 with ZeRO-2 runs on DeepSpeed's plain engine (whole-module files, no layer
    files); its export gives the job's next loss and DeepSpeed's own fp32 weights."""
    from safetensors.torch import load_file

    sets = ["train.steps=4", "parallel.zero_stage=2", "parallel.dp=2"]
    run = tmp_path / "run"
    torchrun(run, 2, sets=sets, extra=["--stop-at-step", "3"])
    torchrun(run, 2, sets=sets)  # its step 4 trains with step 3's weights
    cfg = export(f"file://{run}/store/tiny", tmp_path / "out", step=3)
    assert cfg["zero_stage"] == 2 and cfg["source_layout"]["dp"] == 2
    job = build_job_config("tiny", sets)
    assert cfg["parameters"] == job.model.n_params()

    assert (run / "ckpt" / "latest").read_text() == "global_step4"
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    (run / "ckpt" / "latest").write_text("global_step3")  # DeepSpeed's view of step 3
    theirs = _fp32_by_deepspeed(run / "ckpt")
    assert set(theirs) == set(ours) and all(torch.equal(theirs[k], ours[k]) for k in ours)

    model = load_exported(tmp_path / "out")
    plan = BatchPlan(job, dp=1, dp_rank=0)
    with torch.no_grad():
        micro = [model(torch.from_numpy(x), torch.from_numpy(y)).item()
                 for x, y in plan.step_iterator(3)]
    assert sum(micro) / len(micro) == pytest.approx(losses(run)[4], rel=1e-5, abs=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_of_a_zero3_checkpoint_gathers_the_partitioned_weights(tmp_path):
    """ZeRO-3 keeps no module weights: export gathers them from the DP ranks' optimizer shards."""
    from safetensors.torch import load_file

    sets = ["train.steps=2", "checkpoint.interval=2", "parallel.zero_stage=3", "parallel.dp=2"]
    run = tmp_path / "run"
    torchrun(run, 2, sets=sets)
    cfg = export(f"file://{run}/store/tiny", tmp_path / "out")
    assert cfg["step"] == 2 and cfg["zero_stage"] == 3 and cfg["dtype"] == "float32"
    assert cfg["parameters"] == build_job_config("tiny", sets).model.n_params()
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    theirs = _fp32_by_deepspeed(run / "ckpt")
    assert set(theirs) == set(ours) and all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert load_exported(tmp_path / "out") is not None
