"""Resume determinism: 10 steps in one go equal 5 steps, a checkpoint, a fresh start, 5 more."""

import pytest

from support import losses, records, torchrun

SETS = ["train.steps=10", "train.warmup_steps=3", "parallel.pp=2", "parallel.dp=2",
        "parallel.zero_stage=1"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_reproduces_uninterrupted_losses(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    torchrun(whole, 4, sets=SETS)
    torchrun(split, 4, sets=SETS, extra=["--stop-at-step", "5"])
    first = losses(split)
    assert sorted(first) == [1, 2, 3, 4, 5]
    assert (split / "store" / "tiny" / "ckpt" / "step-00000005" / "MANIFEST.json").is_file()
    torchrun(split, 4, sets=SETS)  # a fresh process group loads step 5 and continues
    start = [r for r in records(split, 0, "start")]
    assert [r["step"] for r in start] == [0, 5]
    reference, resumed = losses(whole), losses(split)
    assert sorted(resumed) == list(range(1, 11))
    for step in range(1, 11):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=0), step
    # TensorBoard event files, read back by tensorboard's own reader, cover both runs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(split / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s",
            "perf/step_time_s", "checkpoint/blocked_s", "faults/restarts"} <= tags
    tb_loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(tb_loss) == list(range(1, 11))
    assert tb_loss[7] == pytest.approx(resumed[7], rel=1e-6)
    assert [e.step for e in acc.Scalars("checkpoint/blocked_s")] == [5, 10]
