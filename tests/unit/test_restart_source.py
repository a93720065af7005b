"""Where a restarted group's restore read its checkpoint: rank 0's `restoring` record (written
before its `start`) gives the restart's incident and event its `source`, "node_memory" when the
crashed workers' newest save was mapped back from /dev/shm (checkpoints/node_memory.py)."""

from __future__ import annotations

from ds3d.daemon.incidents import IncidentClock
from ds3d.daemon.reports import record_to_event


def _rec(kind: str, t: float, **fields: object) -> dict:
    return {"kind": kind, "time": t, "rank": 0, "restart": fields.pop("restart", 0), **fields}


def test_an_agent_restart_says_it_restored_from_node_memory() -> None:
    clock = IncidentClock()
    records = [_rec("step", float(n), step=n) for n in range(1, 9)] + [
        _rec("checkpoint", 12.0, step=6, phase="restoring", durable=False,
             source="node_memory", restart=1),
        _rec("start", 13.0, step=6, restart=1, process_started=10.0),
        _rec("step", 14.0, step=7, restart=1)]
    [inc] = clock.observe(records, agent_cause="worker_exit")
    assert inc.resumed_from == 6 and inc.steps_lost == 2 and inc.source == "node_memory"
    assert inc.as_detail()["source"] == "node_memory"
    assert "(read from node_memory)" in inc.message()


def test_a_restoring_record_of_another_step_is_not_the_restarts() -> None:
    clock = IncidentClock()
    records = [_rec("step", float(n), step=n) for n in range(1, 9)] + [
        _rec("checkpoint", 12.0, step=4, phase="restoring", source="local", restart=1),
        _rec("start", 13.0, step=6, restart=1, process_started=10.0),
        _rec("step", 14.0, step=7, restart=1)]
    [inc] = clock.observe(records, agent_cause="worker_exit")
    assert inc.source is None


def test_the_restoring_event_names_its_source() -> None:
    ev = record_to_event(_rec("checkpoint", 1.0, step=6, phase="restoring",
                              source="node_memory", durable=False))
    assert ev is not None and ev["message"].startswith("checkpoint step 6 restoring from node "
                                                       "memory")


def test_memory_only_snapshot_records_read_as_what_they_are() -> None:
    """`held_in_memory` (checkpoint.memory_interval) and `memory_snapshots_off` are events with
    a message of their own, never rows of the checkpoint index (no files to list)."""
    from ds3d.daemon.reports import INDEXED_PHASES

    held = record_to_event(_rec("checkpoint", 1.0, step=8, phase="held_in_memory",
                                blocked_s=0.0123))
    assert held is not None and held["message"] == (
        "step 8 held in memory only (a memory-only snapshot for rollbacks and crash restarts, "
        "no files; training blocked 0.0123 s)")
    off = record_to_event(_rec("checkpoint", 1.0, step=-1, phase="memory_snapshots_off",
                               cause="data_parallel", detail="checkpoint.memory_interval = 2 "
                               "is off for this run: data-parallel size > 1"))
    assert off is not None and off["message"] == (
        "checkpoint.memory_interval = 2 is off for this run: data-parallel size > 1")
    assert not {"held_in_memory", "memory_snapshots_off"} & set(INDEXED_PHASES)
