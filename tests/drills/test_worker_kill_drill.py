"""A worker killed from outside is named, with its signal, not its peers: the real `ds3dd`, the
real trainer (TP 2 x PP 2 on CPU/gloo) under the elastic agent, `launch.max_restarts=1`, rank 2's
worker SIGKILLed twice (an outside probe of 12-06: the job FAILED blaming rank 0's "Connection
closed by peer", and the first kill, which the agent restarted from by itself, left no fault
event at all). No checkpoint is saved (interval 0: on demand only): the second kill comes before
any progress, so the budget is spent (a checkpoint committed in between would renew it).

Heavy: run serialised, `flock /tmp/ds3d-heavy.lock .venv/bin/pytest tests/drills/...`.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from support import records  # noqa: E402
from test_daemon_support import DaemonProc, kill_job_processes, wait_reported_step  # noqa: E402

pytestmark = [pytest.mark.slow]

KILLED = "rank 2 failed first: killed by SIGKILL (signal 9)"


def kill_rank(run_dir: Path, rank: int, timeout_s: float = 300.0) -> int:
    """SIGKILLs the live worker of `rank` (found by its process title); its pid."""
    from ds3d.daemon.procs import job_workers

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [p.pid for p, t in job_workers(run_dir).items() if t.rank == rank]
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            return pids[0]
        time.sleep(0.1)
    raise AssertionError(f"no worker of rank {rank} in {timeout_s} s")


def wait_restarted_step(run_dir: Path, restart: int, timeout_s: float = 400.0) -> None:
    """Until rank 0 of group `restart` has trained a step (its group runs whole)."""
    deadline = time.monotonic() + timeout_s
    while not any(r["kind"] == "step" and r.get("restart") == restart
                  for r in records(run_dir, 0)):
        assert time.monotonic() < deadline, f"no step of group {restart} in {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.timeout(900)
def test_a_sigkilled_rank_is_named_with_its_signal_in_fault_and_failure(tmp_path):
    sock_dir = Path(tempfile.mkdtemp(prefix="ds3d-", dir="/tmp"))
    d = DaemonProc(tmp_path / "state", listen=f"unix:{sock_dir}/ds3dd.sock")
    d.start()
    try:
        r = d.ctl("start", "tiny", "--name", "kill", "--tp", "2", "--pp", "2", "--dp", "1",
                  "--steps", "100000", "--set", "launch.max_restarts=1",
                  "--set", "checkpoint.interval=0")
        assert r.returncode == 0, r.stderr
        run_dir = Path(d.wait_state("kill", "RUNNING", timeout_s=400)["run_dir"])
        wait_reported_step(run_dir, 2, timeout_s=400)
        kill_rank(run_dir, 2)  # the agent restarts the group by itself (1 restart left)
        wait_restarted_step(run_dir, 1)
        deadline = time.monotonic() + 120  # the daemon's tail of the reports follows
        evs = d.event_details("kill")
        while not any(e["kind"] == "recovery" for e in evs):
            assert time.monotonic() < deadline, [e["message"] for e in evs]
            time.sleep(0.3)
            evs = d.event_details("kill")
        faults = [e for e in evs if e["kind"] == "fault"]
        assert [(e["cause"], e["rank"]) for e in faults] == [("worker_exit", 2)], \
            [e["message"] for e in evs]
        assert KILLED in faults[0]["message"] and "the agent restarts the group" in \
            faults[0]["message"], faults[0]["message"]
        assert faults[0]["detail"]["signal"] == "SIGKILL"
        # the fault comes before the restarted group's recovery event
        order = [(e["kind"], e["cause"]) for e in evs if e["kind"] in ("fault", "recovery")]
        assert order[:2] == [("fault", "worker_exit"), ("recovery", "worker_exit")], order

        kill_rank(run_dir, 2)  # the budget is spent: the job fails, naming rank 2 again
        job = d.wait_state("kill", "FAILED", "COMPLETED", timeout_s=400)
        assert job["state"] == "FAILED", job
        msg = job["message"]
        assert "restart budget spent (1 of 1 restarts used, in a row without a new " \
            "checkpoint)" in msg and KILLED in msg, msg
        assert "rank 0 failed first" not in msg, msg
    finally:
        d.stop()
        kill_job_processes(d.state_dir)
        shutil.rmtree(sock_dir, ignore_errors=True)
