"""Why a start of rank 0 is not the job's first, read from rank 0's own report file: the cause
TensorBoard's restarts/<cause> marker is logged under (trainer/tensorboard.py)."""

import pytest

from ds3d.trainer.tensorboard import restart_cause

pytestmark = pytest.mark.timeout(60)


def rec(pid, kind, restart=0, **kw):
    return {"kind": kind, "pid": pid, "rank": 0, "restart": restart, **kw}


def run(pid, *, restart=0, world=4, end=None, step=0):
    out = [rec(pid, "heartbeat", restart, step=step, phase="init"),
           rec(pid, "start", restart, step=step, world_size=world)]
    if end:
        out.append(rec(pid, "done", restart, step=step + 5, reason=end))
    return out


def now(pid, *, loaded=None, rolled_back=False, restart=0):
    """This process's records before TensorBoardLog is built (init/load heartbeats)."""
    out = [rec(pid, "heartbeat", restart, step=0, phase="init")]
    if loaded is not None:
        out.append(rec(pid, "checkpoint", restart, step=loaded, phase="loaded"))
    if rolled_back:
        out.append(rec(pid, "checkpoint", restart, step=loaded, phase="rolled_back"))
    return out


def test_first_start_has_no_cause():
    assert restart_cause(now(10), 10, 4, 0) is None


def test_clean_end_then_a_new_launch_is_named_after_the_reason():
    records = run(10, end="paused") + now(20, loaded=5)
    assert restart_cause(records, 20, 4, 0) == ("after_paused", 5)
    records = run(10, end="repartition") + now(20, loaded=8)
    assert restart_cause(records, 20, 4, 0) == ("after_repartition", 8)


def test_agent_group_restart_is_worker_exit_or_a_node_change():
    assert restart_cause(run(10) + now(20, loaded=4, restart=1), 20, 4, 1) == ("worker_exit", 4)
    assert restart_cause(run(10) + now(20, loaded=4, restart=1), 20, 2, 1) == ("node_lost", 4)
    assert restart_cause(run(10, world=2) + now(20, restart=1), 20, 4, 1) == ("node_joined", 0)


def test_rollback_and_unclean_relaunch():
    records = run(10, end="paused") + now(20, loaded=6, rolled_back=True)
    assert restart_cause(records, 20, 4, 0) == ("rollback", 6)
    # the daemon killed the previous workers (hang, crash past the agent's budget, OOM)
    assert restart_cause(run(10) + now(20, loaded=6), 20, 4, 0) == ("unclean_exit", 6)
    # only the run just before counts: an older clean pause does not hide a later crash
    records = run(7, end="paused") + run(10, step=5) + now(20, loaded=6)
    assert restart_cause(records, 20, 4, 0) == ("unclean_exit", 6)
