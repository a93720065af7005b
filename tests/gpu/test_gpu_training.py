"""The trainer on a real GPU: NCCL backend, bf16 and fp16, NaN detection on GPU tensors.
Skipped on machines without CUDA (pytest -m gpu runs them on the GPU machine)."""

import json

import pytest

from support import losses, records, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GPU_ENV = {"DS_ACCELERATOR": "cuda", "NCCL_NVLS_ENABLE": "0"}
BASE = ['launch.device="cuda"', "train.steps=10", "train.warmup_steps=2", "checkpoint.interval=2",
        "model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.seq_len=256"]


def _inject(run_dir, **req):
    (run_dir / "control").mkdir(parents=True, exist_ok=True)
    (run_dir / "control" / "inject.json").write_text(json.dumps({"id": 1, **req}))


@pytest.mark.timeout(400)
def test_bf16_learns_real_text_with_nccl_and_tracks_fp32(tmp_path):
    """bf16 autocast on NCCL learns (the CPU suite's real-text check, on the GPU) and stays
    close to the fp32 run of the same data and seeds: a broken bf16 path (wrong dtype casts,
    loss scaling where none belongs) diverges from fp32 within a few steps."""
    from ds3d.trainer.data import encode_text

    from support import REPO

    data = tmp_path / "text.bin"
    encode_text(REPO / "trainer" / "assets" / "public_domain.txt", data)
    source = f"data.source={str(data)!r}".replace("'", '"')
    sets = BASE + ["checkpoint.interval=0", source, "train.steps=60", "parallel.pp=1"]
    runs = {}
    for prec in ("bf16", "fp32"):
        run = tmp_path / prec
        torchrun(run, 1, sets=sets + [f'train.precision="{prec}"'], env=GPU_ENV)
        assert records(run, 0, "start")[0]["device"] == "cuda:0"
        runs[prec] = losses(run)
        assert sorted(runs[prec]) == list(range(1, 61))
    bf16, fp32 = runs["bf16"], runs["fp32"]
    first, last = sum(bf16[s] for s in range(1, 6)) / 5, sum(bf16[s] for s in range(56, 61)) / 5
    assert last < first - 2.0, (first, last)
    for step in (1, 2, 5, 10, 30, 60):
        assert bf16[step] == pytest.approx(fp32[step], rel=0.05), (step, bf16[step], fp32[step])


@pytest.mark.timeout(300)
def test_fp16_overflow_is_skipped_by_the_loss_scaler_not_rolled_back(tmp_path):
    _inject(tmp_path, kind="nan", rank=0, at_step=4)
    torchrun(tmp_path, 1, sets=BASE + ['train.precision="fp16"'], env=GPU_ENV)
    steps = {r["step"]: r for r in records(tmp_path, 0, "step")}
    assert steps[4]["skipped"] is True
    # one overflow: the step is skipped; the scale halves only after `hysteresis` (DeepSpeed's
    # default 2) consecutive overflows, so it never grows past the one before the overflow
    assert steps[5]["loss_scale"] <= steps[3]["loss_scale"]
    assert records(tmp_path, 0, "recovery") == []
    assert sorted(steps) == list(range(1, 11))
    # the loss scale is in TensorBoard (fp16 only), read back by tensorboard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scale = {e.step: e.value for e in acc.Scalars("train/loss_scale")}
    assert sorted(scale) == list(range(1, 11))
    assert scale[3] == pytest.approx(steps[3]["loss_scale"]) and scale[5] <= scale[3]


@pytest.mark.timeout(300)
def test_bf16_nan_on_gpu_rolls_back_to_the_checkpoint(tmp_path):
    """`faults.skip_batches` = 2 makes the NaN a rollback (BF16_Optimizer skipped the update,
    which alone would be undone in place: the next test), so the checkpoint path is the one
    tested here; the window is still one batch, as the rollback's target is step 4."""
    _inject(tmp_path, kind="nan", rank=0, at_step=5)
    torchrun(tmp_path, 1, sets=BASE + ['train.precision="bf16"', "faults.skip_batches=2"],
             env=GPU_ENV)
    rec = records(tmp_path, 0, "recovery")
    # at ~15 ms a step, step 4's checkpoint is still uploading when step 5 fails: the rollback
    # waits for its commit rather than finding nothing committed (or an older one)
    seen = [r for k in ("fault", "checkpoint", "done") for r in records(tmp_path, 0, k)]
    assert len(rec) == 1 and rec[0]["recovered_to"] == 4, seen
    assert rec[0]["source"] in ("memory", "local"), rec
    assert rec[0]["skipped_batches"] == [4, 5]
    got = losses(tmp_path)
    assert all(v == v for v in got.values())  # no NaN survives in the reported losses
    assert sorted(got) == list(range(1, 11))


@pytest.mark.timeout(300)
def test_bf16_nan_on_gpu_is_undone_in_place(tmp_path):
    """BF16_Optimizer's norm (ds3d's fused one on CUDA) sees the NaN and skips the update: the
    step is undone in place, nothing read, one step lost, and no NaN survives."""
    _inject(tmp_path, kind="nan", rank=0, at_step=5)
    torchrun(tmp_path, 1, sets=BASE + ['train.precision="bf16"'], env=GPU_ENV)
    [rec] = records(tmp_path, 0, "recovery")
    assert rec["source"] == "skipped_update", rec
    assert (rec["recovered_to"], rec["steps_lost"], rec["skipped_batches"]) == (4, 1, [4, 5])
    got = losses(tmp_path)
    assert all(v == v for v in got.values())
    assert sorted(got) == list(range(1, 11))
