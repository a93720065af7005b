"""`checkpoint.interval = "auto"` in a real job: two ranks (DP 2) under torchrun, a prior MTBF of
a few seconds so that Young-Daly asks for a save every few steps on CPU. Rank 0 measures each
save's cost (blocked + time to commit in the file store) and the interval follows; every rank
saves at the same step (the checkpoints commit, so both ranks' parts were there)."""

import math

import pytest

from support import records, torchrun

pytestmark = pytest.mark.slow

PRIOR_H = 0.0002  # 0.72 s: with C ~ 0.05-0.5 s, sqrt(2 C MTBF) is a few steps of `tiny`


def test_auto_interval_saves_at_the_measured_young_daly_interval(tmp_path):
    run = tmp_path / "run"
    torchrun(run, 2, sets=["train.steps=150", "parallel.dp=2", 'checkpoint.interval="auto"',
                           f"checkpoint.auto_mtbf_prior_hours={PRIOR_H}",
                           "checkpoint.auto_initial_save_cost_s=1.0"])
    decisions = records(run, 0, "checkpoint_interval")
    ckpts = records(run, 0, "checkpoint")
    saved = [r for r in ckpts if r["phase"] == "saved"]
    committed = {r["step"] for r in ckpts if r["phase"] == "committed"}

    # the first decision is the guess (C = 1 s, MTBF = the prior), then measured ones
    first = decisions[0]
    assert not first["measured"] and first["save_cost_s"] == 1.0
    assert first["interval_s"] == pytest.approx(math.sqrt(2 * 1.0 * PRIOR_H * 3600), rel=1e-3)
    measured = [d for d in decisions if d["measured"]]
    assert measured, f"no measured interval after {len(saved)} saves: {decisions}"
    for d in decisions:  # each decision is the formula on its own inputs
        assert d["save_cost_s"] == pytest.approx(d["blocked_s"] + d["commit_s"], abs=2e-3)
        # (the record rounds every figure to 1 ms)
        assert d["young_daly_s"] == pytest.approx(
            math.sqrt(2 * d["save_cost_s"] * d["mtbf_s"]), rel=1e-2, abs=2e-3)
        assert d["interval_s"] == pytest.approx(max(d["young_daly_s"], d["commit_s"]), abs=2e-3)
        assert d["mtbf_s"] == pytest.approx(PRIOR_H * 3600)  # no daemon: no failures observed

    # saves were made by the clock (more than the final one), every one committed (both ranks'
    # parts present: both ranks saved at that step), none sooner than the interval in force
    assert len(saved) >= 3, saved
    assert {r["step"] for r in saved} <= committed
    start = records(run, 0, "start")[0]["time"]
    previous = start
    for save in saved[:-1]:  # the last one is the end-of-job save
        in_force = [d for d in decisions if d["time"] <= save["time"]][-1]
        assert save["time"] - previous >= in_force["interval_s"] - 0.05, (save, in_force)
        previous = save["time"]
    assert saved[-1]["step"] == 150
