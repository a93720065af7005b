"""`checkpoint.memory_interval = "auto"` in a real job: two ranks under ds3d's node agent, gloo
on CPU, TP 2 (memory-only snapshots are off with DP > 1), a durable save every 20 steps.

The failure history is the daemon's file (control/failures.json, written here as ds3dd would:
9 failures in no running time with a prior of 7.2 s, so MTBF = 0.72 s): with a CPU snapshot's
few milliseconds, Young-Daly asks for a memory-only snapshot every few steps. Rank 0 takes the
first at once (no cost known yet), measures each one and reports every change of the interval
with its inputs; both ranks hold at the same steps (the per-step all-reduce carries the word),
never sooner than the interval in force, and no memory-only snapshot makes a file. Beside
interval = "auto", one record carries both intervals and the durable one caps the memory one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ds3d.daemon.reports import describe_interval
from ds3d.trainer.checkpoint_interval import FAILURES_FILE

from support import records, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, DURABLE = 40, 20
PRIOR_H = 0.002  # 7.2 s, counted as one failure: with 9 observed, MTBF = 7.2 s / 10


def _run(run: Path, interval: str, *sets: str) -> None:
    """A TP-2 job whose daemon saw 9 failures (MTBF 0.72 s with the prior)."""
    (run / "control").mkdir(parents=True)
    (run / "control" / FAILURES_FILE).write_text(json.dumps({"failures": 9, "observed_s": 0.0}))
    torchrun(run, 2, sets=[f"train.steps={STEPS}", "parallel.tp=2",
                           f"checkpoint.interval={interval}", 'checkpoint.memory_interval="auto"',
                           f"checkpoint.auto_mtbf_prior_hours={PRIOR_H}", *sets])


def _save_steps(run: Path, rank: int) -> list[int]:
    """Steps at which a rank took a snapshot, durable or memory-only (its `save` heartbeats)."""
    return [r["step"] for r in records(run, rank, "heartbeat") if r.get("phase") == "save"]


def test_auto_memory_interval_holds_at_the_measured_young_daly_interval(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run(run, str(DURABLE))
    decisions = records(run, 0, "checkpoint_interval")
    ckpts = records(run, 0, "checkpoint")
    held = [r for r in ckpts if r["phase"] == "held_in_memory"]
    saved = [r for r in ckpts if r["phase"] == "saved"]

    # the first decision knows no cost (the MTBF is already the file's): a snapshot at once;
    # then measured ones, each the formula on its own inputs (figures rounded to 0.1 ms)
    first = decisions[0]
    assert first["memory_cost_source"] == "unmeasured" and first["memory_interval_s"] == 0.0
    measured = [d for d in decisions if d["memory_cost_source"] == "memory"]
    assert measured, decisions
    for d in decisions:
        assert "interval_s" not in d  # an integer durable interval: the memory part alone
        assert d["memory_mtbf_s"] == pytest.approx(PRIOR_H * 3600 / 10, abs=1e-3)
        assert d["memory_young_daly_s"] == pytest.approx(
            math.sqrt(2 * d["memory_snapshot_cost_s"] * d["memory_mtbf_s"]), rel=1e-2, abs=1e-3)
        floor = max(d["memory_young_daly_s"], d["memory_step_s"])
        want = d["memory_durable_s"] if d["memory_capped"] else floor
        assert d["memory_interval_s"] == pytest.approx(want, abs=1e-3), d
        # the step time is rounded to 0.1 ms before the record, so DURABLE times it is off
        # by up to DURABLE x 0.05 ms (CI saw 3.315 against 20 x 0.1657 = 3.314)
        assert d["memory_durable_s"] == pytest.approx(DURABLE * d["memory_step_s"],
                                                      abs=DURABLE * 1e-4), d
        assert describe_interval(d).startswith("memory-only snapshot every"), d

    # memory-only snapshots were taken by the clock, between the durable saves
    assert len(held) >= 3, (held, decisions)
    assert held[0]["step"] == 1  # at once, to measure the cost
    assert all(r["step"] % DURABLE for r in held)
    assert [r["step"] for r in saved] == [DURABLE, STEPS]
    # never sooner than the interval in force after the newest snapshot (held or saved)
    snapshots = sorted(held + saved, key=lambda r: r["time"])
    previous = records(run, 0, "start")[0]["time"]
    for snap in snapshots[:-1]:  # the last one is the end-of-job save
        in_force = [d for d in decisions if d["time"] <= snap["time"]][-1]
        if snap["phase"] == "held_in_memory":
            assert snap["time"] - previous >= in_force["memory_interval_s"] - 0.05, (snap,
                                                                                    in_force)
        previous = snap["time"]

    # both ranks held at the same steps: the word travelled in the per-step all-reduce
    assert _save_steps(run, 0) == _save_steps(run, 1) == sorted({r["step"] for r in held + saved})

    # no memory-only snapshot made a folder or an object
    assert sorted(p.name for p in (run / "ckpt").iterdir()
                  if p.name.startswith("global_step")) == ["global_step20", "global_step40"]
    assert sorted(p.name for p in (run / "store" / "tiny" / "ckpt").iterdir()) == [
        "step-00000020", "step-00000040"]


def test_auto_memory_interval_beside_an_auto_durable_interval(tmp_path: Path) -> None:
    """Both "auto": one record per change carries both intervals, from one MTBF; the memory
    one is capped by the durable one in force; memory-only snapshots fill the gaps between
    the clock's durable saves, on both ranks at the same steps."""
    run = tmp_path / "run"
    _run(run, '"auto"', "checkpoint.auto_initial_save_cost_s=1.0")
    decisions = records(run, 0, "checkpoint_interval")
    ckpts = records(run, 0, "checkpoint")
    held = [r["step"] for r in ckpts if r["phase"] == "held_in_memory"]
    saved = [r["step"] for r in ckpts if r["phase"] == "saved"]
    assert decisions[0]["memory_cost_source"] == "unmeasured"
    for d in decisions:
        assert d["mtbf_s"] == pytest.approx(d["memory_mtbf_s"], abs=1e-3) == pytest.approx(
            PRIOR_H * 3600 / 10, abs=1e-3)
        assert d["memory_durable_s"] == pytest.approx(d["interval_s"], abs=2e-3), d
        assert d["memory_interval_s"] <= d["interval_s"] + 2e-3, d
        line = describe_interval(d)
        assert line.startswith("checkpoint every") and "; memory-only snapshot every" in line
    assert held and held[0] == 1, (held, decisions)
    assert len(saved) >= 2 and not set(held) & set(saved), (held, saved)
    assert _save_steps(run, 0) == _save_steps(run, 1) == sorted(held + saved)
