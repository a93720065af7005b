"""Fault drills at the trainer level, real processes under ds3d's node agent (torch elastic's
LocalElasticAgent, tests/support.torchrun) without a daemon, gloo on CPU, at (TP, PP, DP) =
(2, 2, 1)."""

import json

import pytest

from support import losses, records, torchrun

SETS = ["train.steps=8", "train.warmup_steps=2", "parallel.tp=2", "parallel.pp=2",
        "checkpoint.interval=2"]


def _inject(run_dir, **req):
    (run_dir / "control").mkdir(parents=True, exist_ok=True)
    (run_dir / "control" / "inject.json").write_text(json.dumps({"id": 1, **req}))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_nan_rolls_back_and_equals_a_run_that_skipped_the_window(tmp_path):
    """fp32 at ZeRO 0: the plain torch optimizer applies the NaN update (ZeRO 1/2 and bf16
    would skip it and the step is undone in place instead: test_nan_in_place.py), so only a
    rollback brings back good weights."""
    sets = SETS + ["parallel.zero_stage=0"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    torchrun(ref, 4, sets=sets + ["data.skip_batches=[[4, 5]]"])
    _inject(run, kind="nan", rank=1, at_step=5)  # rank 1: stage 0, second TP rank
    torchrun(run, 4, sets=sets)
    faults = records(run, 0, "fault")
    assert [(f["cause"], f["step"]) for f in faults] == [("nan", 5)]
    assert "loss=nan" in faults[0]["detail"]
    bad = next(r for r in records(run, 0, "step") if r["step"] == 5)
    assert bad["loss"] != bad["loss"] and not bad["skipped"]  # NaN, and the update applied
    rec = records(run, 0, "recovery")
    # the newest save, step 4's, read back from its host copy: no wait for its files or upload
    assert len(rec) == 1 and rec[0]["recovered_to"] == 4 and rec[0]["source"] == "memory", rec
    assert rec[0]["skipped_batches"] == [4, 5]
    assert rec[0]["steps_lost"] == 1
    want, got = losses(ref), losses(run)
    assert sorted(got) == list(range(1, 9))
    for step in range(1, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step
    # the skip is part of the data position of later checkpoints
    manifest = json.loads((run / "store" / "tiny" / "ckpt" / "step-00000008" / "MANIFEST.json")
                          .read_text())
    assert manifest["data_position"]["skip_batches"] == [[4, 5]]


SPIKE_SETS = ["train.steps=12", "train.warmup_steps=2", "parallel.tp=2", "parallel.pp=2",
              "checkpoint.interval=2", "faults.spike_policy=rollback", "faults.spike_window=5",
              "faults.spike_mads=20"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_spike_rollback_past_the_newest_save_reads_the_local_tier(tmp_path):
    """A spike from step 7 on rank 3 (last stage), declared at step 9 (patience 3): step 8's
    save, the one held in host memory, was trained on a suspect step, so the rollback goes to
    step 6 from the local tier; losses equal a run that skipped the same window."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    _inject(run, kind="spike", rank=3, at_step=7)
    torchrun(run, 4, sets=SPIKE_SETS)
    assert [(f["cause"], f["step"]) for f in records(run, 0, "fault")] == [("spike", 9)]
    rec = records(run, 0, "recovery")
    assert len(rec) == 1 and rec[0]["source"] == "local", rec
    assert rec[0]["recovered_to"] == 6 and rec[0]["dropped_checkpoints"] == [8], rec
    window = rec[0]["skipped_batches"]
    assert window == [6, 9]  # batches 6..8 fed steps 7..9
    torchrun(ref, 4, sets=SPIKE_SETS + [f"data.skip_batches=[{window}]"])
    want, got = losses(ref), losses(run)
    assert sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_crashed_worker_is_restarted_by_the_agent_and_resumes(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    torchrun(ref, 4, sets=SETS)
    _inject(run, kind="crash", rank=2, at_step=6)
    # ds3d's agent (torch elastic's LocalElasticAgent restart loop, forked workers): the
    # restarted group is a fork per rank, not four more imports of torch and DeepSpeed.
    # Plain torchrun runs the trainer in test_job_identity and test_two_commits.
    torchrun(run, 4, sets=SETS, max_restarts=2, timeout=500)  # raises unless it exits 0
    starts = [(s["restart"], s["step"]) for s in records(run, 0, "start")]
    # resumed from the newest save before the crash at step 6 (step 4's, held in node memory,
    # or step 2's from disk), in the group's one restart: neither the rendezvous port nor
    # MASTER_PORT can be taken by a bind(0) or a parallel test before it is bound
    # (daemon/ports.py), so the first group is no restart
    assert starts[0] == (0, 0) and len(starts) == 2
    assert starts[1][0] == 1 and starts[1][1] in (2, 4)
    assert (run / "control" / "inject-done-1").read_text() == "6"
    want, got = losses(ref), losses(run)
    for step in range(1, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step
