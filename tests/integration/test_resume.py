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
