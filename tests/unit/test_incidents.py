"""The incident clock: time to detect, time to recover and steps lost of each recovered fault,
from the report records in the order the daemon sees them."""

from __future__ import annotations

import pytest

from ds3d.daemon.incidents import IncidentClock


def step(n: int, t: float, rank: int = 0) -> dict:
    return {"kind": "step", "step": n, "time": t, "rank": rank, "restart": 0}


def start(n: int, t: float, restart: int = 0, spawned: float | None = None) -> dict:
    return {"kind": "start", "step": n, "time": t, "rank": 0, "restart": restart,
            "process_started": spawned}


def test_daemon_fault_is_timed_from_the_last_step_to_the_first_step_after():
    clock = IncidentClock()
    assert clock.observe([step(n, float(n)) for n in range(1, 6)]) == []
    clock.fault("hang", now=20.0)          # detector fired 15 s after step 5
    assert clock.observe([start(4, 30.0)]) == []  # the relaunched group resumes from step 4
    [inc] = clock.observe([step(5, 32.0), step(6, 33.0)])
    assert (inc.cause, inc.noticed_by) == ("hang", "daemon")
    assert inc.time_to_detect_s == pytest.approx(15.0)
    assert inc.time_to_recover_s == pytest.approx(12.0)
    assert inc.steps_lost == 1 and inc.resumed_from == 4
    assert "recovered from hang" in inc.message() and "1 step(s) trained again" in inc.message()
    assert clock.open is None


def test_agent_restart_is_timed_from_the_new_group_spawn():
    clock = IncidentClock()
    records = [step(n, float(n)) for n in range(1, 7)] + [
        start(4, 15.0, restart=1, spawned=10.0), step(5, 16.0)]
    records.reverse()  # files of several ranks: the clock orders by time
    [inc] = clock.observe(records, agent_cause="worker_exit")
    assert (inc.cause, inc.noticed_by) == ("worker_exit", "agent")
    assert inc.time_to_detect_s == pytest.approx(4.0)   # spawn 10 s - step 6 at 6 s
    assert inc.time_to_recover_s == pytest.approx(6.0)  # first step 16 s - spawn
    assert inc.steps_lost == 2


def test_a_shrunk_group_whose_rank_0_did_not_restart_is_a_lost_node_incident():
    # rank 0 moved to a node whose agent re-rendezvoused for the membership change (restart 0)
    clock = IncidentClock()
    clock.observe([step(n, float(n)) for n in range(1, 13)])
    assert clock.observe([start(10, 20.0, restart=0, spawned=18.0)], agent_cause="node_lost") \
        == []
    [inc] = clock.observe([step(11, 21.0)])
    assert (inc.cause, inc.noticed_by, inc.steps_lost) == ("node_lost", "agent", 2)


def test_a_second_fault_during_recovery_joins_the_first():
    clock = IncidentClock()
    clock.observe([step(1, 1.0), step(2, 2.0)])
    clock.fault("agent_exit", now=5.0)
    clock.observe([start(2, 8.0, restart=1, spawned=7.0)], agent_cause="worker_exit")
    clock.fault("hang", now=30.0)  # the relaunched group hung before its first step
    clock.observe([start(2, 40.0)])
    [inc] = clock.observe([step(3, 42.0)])
    assert inc.cause == "agent_exit" and inc.time_to_recover_s == pytest.approx(37.0)


def test_in_process_rollback_is_closed_by_its_own_record():
    clock = IncidentClock()
    rec = {"kind": "recovery", "cause": "nan", "step": 7, "recovered_to": 6, "steps_lost": 1,
           "seconds": 0.4, "time": 9.0, "rank": 0}
    [inc] = clock.observe([step(6, 8.0), rec, {**rec, "rank": 1}])
    assert (inc.cause, inc.noticed_by, inc.steps_lost) == ("nan", "workers", 1)
    assert inc.time_to_recover_s == pytest.approx(0.4)
    assert "source" not in inc.as_detail()  # a trainer that did not say where it read from


def test_in_process_rollback_says_where_it_read_the_state_from():
    """The `recovered` event and the `recovery` event name the source (trainer/loop.py)."""
    from ds3d.daemon.reports import record_to_event

    rec = {"kind": "recovery", "cause": "nan", "step": 7, "recovered_to": 6, "steps_lost": 1,
           "seconds": 0.4, "time": 9.0, "rank": 0, "source": "memory",
           "skipped_batches": [6, 7]}
    [inc] = IncidentClock().observe([step(6, 8.0), rec])
    assert inc.as_detail()["source"] == "memory"
    assert "from step 6 (read from memory); 1 step(s) trained again" in inc.message()
    ev = record_to_event(rec)
    assert ev is not None and ev["message"] == (
        "nan at step 7: rolled back to the checkpoint of step 6 (read from memory) in 0.4 s, "
        "batch 6 skipped")


def test_a_bad_step_undone_in_place_says_nothing_was_read():
    """A NaN whose update every rank skipped (trainer/loop.py `_undo_skipped_update`): one step
    lost, and the events say it was undone in place, not read from anywhere."""
    from ds3d.daemon.reports import record_to_event

    rec = {"kind": "recovery", "cause": "nan", "step": 7, "recovered_to": 6, "steps_lost": 1,
           "seconds": 0.0, "time": 9.0, "rank": 0, "source": "skipped_update",
           "skipped_batches": [6, 7]}
    [inc] = IncidentClock().observe([step(6, 8.0), rec])
    assert (inc.steps_lost, inc.resumed_from, inc.as_detail()["source"]) == (
        1, 6, "skipped_update")
    assert ("from step 6 (in place: the update was skipped); 1 step(s) trained again"
            in inc.message())
    ev = record_to_event(rec)
    assert ev is not None and ev["message"] == (
        "nan at step 7: every rank skipped its update; undone in place, back to step 6 in "
        "0.0 s, batch 6 skipped")


def test_planned_restarts_and_ended_jobs_open_nothing():
    clock = IncidentClock()
    clock.observe([step(1, 1.0), start(1, 5.0), step(2, 6.0)])  # pause/resume, repartition
    assert clock.open is None
    assert clock.observe([start(2, 9.0, restart=1, spawned=8.0), step(3, 10.0)],
                         agent_cause="node_joined") == []
    clock.fault("agent_exit", now=12.0)
    clock.drop()  # restart budget spent: FAILED
    assert clock.observe([start(2, 20.0), step(3, 21.0)]) == []
