"""`checkpoint.memory_interval = "auto"`: Young-Daly for memory-only snapshots on a simulated
fault history and simulated snapshot costs (trainer/checkpoint_interval.py `MemoryInterval`),
the one record line that reports it (daemon/reports.py), and the config's rules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ds3d.daemon.reports import describe_interval
from ds3d.trainer.checkpoint_interval import (
    EWMA_WEIGHT,
    FAILURES_FILE,
    AutoInterval,
    FailureReading,
    MemoryInterval,
)
from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

H = 3600.0


def _history(control: Path, failures: int, observed_s: float) -> None:
    (control / FAILURES_FILE).write_text(json.dumps({"failures": failures,
                                                     "observed_s": observed_s}))


def test_memory_interval_follows_snapshot_costs_and_the_shared_fault_history(
        tmp_path: Path) -> None:
    """A job's life: no cost known (a snapshot at once), a durable save's blocked time as the
    stand-in, measured memory-only snapshots (running mean), then failures the daemon saw,
    read once for both clocks."""
    history = FailureReading(tmp_path, prior_hours=6.0, reread_s=0.0)
    durable, memory = AutoInterval(history, initial_cost_s=30.0), MemoryInterval(history)
    d = memory.decision
    assert d.cost_source == "unmeasured" and d.snapshot_cost_s == 0.0 and d.mtbf_s == 6 * H
    assert d.interval_s == 0.0 and memory.due(now=memory.last_snapshot)  # measure it at once

    # the first steps: 0.5 s each; one step is the floor while the cost is unknown
    memory.stepped(0.5)
    d = memory.update(durable_s=durable.decision.interval_s)  # 1138 s (C 30 s guessed)
    assert d is not None and d.step_s == 0.5 and d.interval_s == 0.5 and not d.capped
    assert d.durable_s == pytest.approx(math.sqrt(2 * 30.0 * 6 * H))

    # a durable save blocked 2 s: the same copy, the stand-in until a memory-only one is timed
    memory.saved(blocked_s=2.0, now=100.0)
    d = memory.update(durable_s=1000.0)
    assert d is not None and d.cost_source == "durable" and d.snapshot_cost_s == 2.0
    assert d.interval_s == pytest.approx(math.sqrt(2 * 2.0 * 6 * H))  # 293.9 s
    assert not memory.due(now=100.0 + d.interval_s - 1)  # the durable save reset the clock
    assert memory.due(now=100.0 + d.interval_s + 1)

    # memory-only snapshots blocked 0.4 s, then 0.8 s: C_mem is their running mean
    memory.held(blocked_s=0.4, now=400.0)
    d = memory.update(durable_s=1000.0)
    assert d is not None and d.cost_source == "memory" and d.snapshots == 1
    assert d.snapshot_cost_s == pytest.approx(0.4)
    assert d.interval_s == pytest.approx(math.sqrt(2 * 0.4 * 6 * H))  # 131.5 s
    memory.held(blocked_s=0.8, now=532.0)
    mean = (1 - EWMA_WEIGHT) * 0.4 + EWMA_WEIGHT * 0.8  # 0.5
    d = memory.update(durable_s=1000.0)
    assert d is not None and d.snapshot_cost_s == pytest.approx(mean) and d.snapshots == 2
    assert d.interval_s == pytest.approx(math.sqrt(2 * mean * 6 * H))  # 147.0 s: moved > 10%
    assert memory.update(durable_s=1000.0) is None  # nothing changed: no new report
    assert memory.update(durable_s=1050.0) is None  # the cap moved by 5%: not worth a report
    d = memory.update(durable_s=1200.0)  # by 20%: reported, though tau_mem stays
    assert d is not None and d.durable_s == 1200.0 and d.snapshot_cost_s == pytest.approx(mean)
    d = memory.update(durable_s=1000.0, force=True)  # a new durable decision: always renewed
    assert d is not None and d.durable_s == 1000.0

    # the daemon saw 3 failures in 2 h of running: MTBF (6 + 2) / 4 = 2 h for both clocks
    _history(tmp_path, 3, 2 * H)
    assert history.read(now=600.0)
    dd = durable.update()
    d = memory.update(durable_s=1000.0)
    assert dd is not None and d is not None
    assert d.failures == dd.failures == 3 and d.mtbf_s == dd.mtbf_s == pytest.approx(2 * H)
    assert d.interval_s == pytest.approx(math.sqrt(2 * mean * 2 * H))  # 84.9 s
    assert d.young_daly_s == d.interval_s
    assert not memory.due(now=532.0 + d.interval_s - 1) and memory.due(now=532.0 + d.interval_s)


def test_memory_interval_is_at_least_one_step_and_at_most_the_durable_interval(
        tmp_path: Path) -> None:
    history = FailureReading(tmp_path, prior_hours=6.0, reread_s=0.0)
    # failures every 25 s (1000 in 7 h with the prior): Young-Daly 5 s, but a step takes 8 s
    _history(tmp_path, 1000, 1 * H)
    history.read(now=0.0)
    memory = MemoryInterval(history)
    memory.held(blocked_s=0.5, now=0.0)
    memory.stepped(8.0)
    d = memory.update(durable_s=400.0)
    assert d is not None
    assert d.young_daly_s == pytest.approx(math.sqrt(2 * 0.5 * 7 * H / 1001))  # 5.0 s
    assert d.interval_s == 8.0 and not d.capped
    assert memory.due(now=8.0)

    # a durable interval shorter than Young-Daly's: capped, no memory-only snapshot is taken
    history2 = FailureReading(tmp_path / "none", prior_hours=6.0, reread_s=0.0)
    slow = MemoryInterval(history2)
    slow.saved(blocked_s=2.0, now=0.0)
    slow.stepped(0.5)
    d = slow.update(durable_s=100 * 0.5)  # interval = 100 steps of 0.5 s
    assert d is not None and d.capped and d.young_daly_s == pytest.approx(293.9, abs=0.1)
    assert d.interval_s == 50.0 and d.durable_s == 50.0
    assert not slow.due(now=10_000.0)
    assert "capped at the durable interval 50 s (none taken" in describe_interval(d.record())
    d = slow.update(durable_s=1000.0)  # a longer durable interval: uncapped again
    assert d is not None and not d.capped and d.interval_s == pytest.approx(293.9, abs=0.1)


def test_one_record_line_names_both_intervals_and_every_input(tmp_path: Path) -> None:
    history = FailureReading(tmp_path, prior_hours=6.0, reread_s=0.0)
    durable, memory = AutoInterval(history, initial_cost_s=30.0), MemoryInterval(history)
    memory.held(blocked_s=0.25, now=0.0)
    memory.stepped(0.5)
    memory.update(durable_s=durable.decision.interval_s)
    rec = {**durable.decision.record(), **memory.decision.record()}
    assert rec["memory_cost_source"] == "memory" and rec["interval_s"] == pytest.approx(
        1138.4, abs=0.1)
    line = describe_interval(rec)
    assert line.startswith("checkpoint every 1138 s")
    assert ("memory-only snapshot every 104 s = sqrt(2 x C_mem 0.250 s x MTBF 6.00 h) = 104 s"
            in line), line
    assert "at least one step 0.5 s, at most the durable interval 19.0 min" in line
    assert "running mean of 1 memory-only snapshot(s)" in line
    assert "0 failure(s) in 0 s running and a prior of 6.00 h" in line

    # memory_interval "auto" beside an integer interval: the memory part alone
    alone = describe_interval(memory.decision.record())
    assert alone.startswith("memory-only snapshot every 104 s"), alone
    fresh = describe_interval(MemoryInterval(history).decision.record())
    assert "not measured yet: a memory-only snapshot is taken at once" in fresh
    assert "at most the durable interval (not known yet)" in fresh


@pytest.mark.parametrize("sets, phrases", [
    (['checkpoint.memory_interval="auto"'],
     ['checkpoint.memory_interval="auto"', "checkpoint.interval=0 makes none",
      'checkpoint.interval to "auto" or an integer', "memory_interval = 0"]),
    (["checkpoint.interval=1", 'checkpoint.memory_interval="auto"'],
     ["checkpoint.interval=1 saves every step durably", "above 1", "memory_interval = 0"]),
    (["checkpoint.interval=10", 'checkpoint.memory_interval="often"'],
     ["checkpoint.memory_interval", "'auto'"]),
])
def test_auto_memory_interval_is_refused_with_what_to_change(sets: list[str],
                                                             phrases: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        build_job_config("tiny", sets)
    for phrase in phrases:
        assert phrase in str(err.value), (phrase, str(err.value))


def test_auto_memory_interval_is_accepted_beside_an_integer_or_auto_interval() -> None:
    for interval in ("2", "100", '"auto"'):
        cfg = build_job_config("tiny", [f"checkpoint.interval={interval}",
                                        'checkpoint.memory_interval="auto"'])
        assert cfg.checkpoint.memory_interval == "auto"
        assert cfg.checkpoint_settings().memory_interval == "auto"
