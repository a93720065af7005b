"""Resume determinism: 10 steps in one go equal 5 steps, a checkpoint, a fresh start, 5 more;
and the TensorBoard event files of the interrupted run, read back by tensorboard's reader."""

import pytest

from ds3d.trainer.config import build_job_config

from support import losses, records, torchrun

SETS = ["train.steps=10", "train.warmup_steps=3", "parallel.pp=2", "parallel.dp=2",
        "parallel.zero_stage=1", "train.timing_interval=1"]  # every step's split (timing only)
PEAK = {"DS3D_PEAK_TFLOPS": "0.5"}  # a CPU has no datasheet peak: MFU against this one


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_reproduces_uninterrupted_losses(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    torchrun(whole, 4, sets=SETS)
    torchrun(split, 4, sets=SETS, extra=["--stop-at-step", "5"], env=PEAK)
    first = losses(split)
    assert sorted(first) == [1, 2, 3, 4, 5]
    assert (split / "store" / "tiny" / "ckpt" / "step-00000005" / "MANIFEST.json").is_file()
    torchrun(split, 4, sets=SETS, env=PEAK)  # a fresh process group loads step 5, continues
    start = [r for r in records(split, 0, "start")]
    assert [r["step"] for r in start] == [0, 5]
    # each start's init heartbeat says when its start-up stages ended (seconds from its
    # process's start, in order), the restore's load heartbeat how its build phase split
    beats = records(split, 0, "heartbeat")
    for init in [b for b in beats if b["phase"] == "init"]:
        stages = init["startup_s"]
        assert list(stages) == ["imported", "config", "device", "process_group", "layout"]
        assert 0 <= stages["imported"] <= stages["config"] <= stages["device"] <= \
            stages["process_group"] <= stages["layout"], stages
    (load,) = [b for b in beats if b["phase"] == "load"]
    assert load["step"] == 5 and load["build_s"]["engine"] > 0 and \
        load["build_s"]["read_wait"] >= 0, load
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
    saved = {r["step"]: r["blocked_s"] for r in records(split, 0, "checkpoint")
             if r["phase"] == "saved"}  # rank 0's own measurement of each save's stall
    assert {e.step: round(e.value, 4) for e in acc.Scalars("checkpoint/blocked_s")} == \
        pytest.approx(saved, abs=1e-4)
    every_step = list(range(1, 11))
    for tag in ("train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu"):
        assert [e.step for e in acc.Scalars(tag)] == every_step, tag
    # MFU = model FLOPs per step / step time / (peak x ranks): 6 N T for the dense matmuls plus
    # 12 L d s T for attention, T = tokens per step (the PaLM appendix B count)
    cfg = build_job_config("tiny", SETS)
    mc, tokens = cfg.model, cfg.train.global_batch_size * cfg.model.seq_len
    flops = 6 * mc.n_params() * tokens + 12 * mc.n_layers * mc.d_model * mc.seq_len * tokens
    step_s = {e.step: e.value for e in acc.Scalars("perf/step_time_s")}
    for e in acc.Scalars("perf/mfu"):
        assert e.value == pytest.approx(flops / step_s[e.step] / (0.5e12 * 4), rel=1e-4), e.step
    assert "train/loss_scale" not in tags  # fp32: no loss scaler (fp16 only)
    # the step-time split of every sampled step (timing_interval=1: step 2 on) with the pipeline
    # bubble beside the 1F1B schedule's (p-1)/(m+p-1), and DP reduction against forward
    for part in ("forward", "backward", "optimizer", "p2p_wait", "dp_reduce", "data",
                 "compute_s", "step_s"):
        assert [e.step for e in acc.Scalars(f"time/{part}")] == every_step[1:], part
    assert all(e.value > 0 for e in acc.Scalars("time/forward"))
    m = 8 // 2 // 2  # global batch / micro-batch / dp micro-batches per step, p = 2
    assert {round(e.value, 4) for e in acc.Scalars("perf/bubble_theoretical")} == \
        {round(1 / (m + 1), 4)}
    assert all(0 <= e.value <= 1 for e in acc.Scalars("perf/bubble"))
    assert [e.step for e in acc.Scalars("perf/reduce_to_forward")] == every_step[1:]
    # restarts: the agent's count at each start, and why the second start happened
    assert [(e.step, e.value) for e in acc.Scalars("faults/restarts")] == [(0, 0), (5, 0)]
    assert [(e.step, e.value) for e in acc.Scalars("restarts/after_paused")] == [(5, 1)]
    assert not any(t.startswith("restarts/") and t != "restarts/after_paused" for t in tags)
