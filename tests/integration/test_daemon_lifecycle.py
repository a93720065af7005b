"""A real ds3dd driven by the real ds3dctl through a job's whole life, with the real elastic
agent and rendezvous process, and a stand-in worker that follows the job-directory contract.

Slow (agents import torch); run serialised: flock /tmp/ds3d-heavy.lock .venv/bin/pytest ..."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from test_daemon_support import DaemonProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture
def daemon(tmp_path):
    with DaemonProc(tmp_path / "state", worker_dir=tmp_path / "worker",
                    extra_env={"FAKE_STEP_S": "0.25", "FAKE_CRASH_AT_STEP": "3"},
                    args=["--hang-timeout", "60"]) as d:
        yield d


def test_run_to_completion(daemon):
    r = daemon.ctl("start", "tiny", "--name", "short", "--steps", "8",
                   "--set", "launch.max_restarts=2")
    assert r.returncode == 0, r.stderr
    assert "started short" in r.stdout
    job = daemon.wait_state("short", "COMPLETED")
    assert job["step"] == 8 and job["loss"] == pytest.approx(10 / 8)
    # the stand-in crashed once at step 3: the agent restarted the group, ds3d counted it
    assert job["restarts"] == 1
    kinds = [e["kind"] for e in daemon.events("short")]
    assert "recovery" in kinds and kinds.count("step") >= 8
    states = [(e["from"], e["to"]) for e in daemon.events("short") if e["kind"] == "state"]
    assert states[0][1] == "PENDING" and states[-1] == ("RUNNING", "COMPLETED")
    r = daemon.ctl("checkpoints", "short", "--json")
    assert [c["step"] for c in json.loads(r.stdout)][-1] == 8
    table = daemon.ctl("status").stdout
    assert "short" in table and "COMPLETED" in table and "8/8" in table
    assert daemon.ctl("logs", "short", "--source", "agent").returncode == 0


def test_save_pause_resume_rollback_stop(daemon):
    assert daemon.ctl("start", "tiny", "--name", "long", "--steps", "100000").returncode == 0
    daemon.wait_for("long", lambda j: j["state"] == "RUNNING" and j["step"] >= 5, "step 5")

    assert daemon.ctl("save", "long").returncode == 0
    job = daemon.wait_for("long", lambda j: j["last_checkpoint_step"] >= 5, "a checkpoint")
    first_ckpt = job["last_checkpoint_step"]

    assert daemon.ctl("pause", "long").returncode == 0
    job = daemon.wait_state("long", "PAUSED")
    paused_at = job["step"]
    assert job["last_checkpoint_step"] == paused_at

    assert daemon.ctl("resume", "long").returncode == 0
    job = daemon.wait_for("long", lambda j: j["state"] == "RUNNING" and j["step"] > paused_at,
                          "progress after resume")
    # the resumed agent restarts its group only as often as the job's budget has left: the
    # crash at step 3 used one of the default 3, but a checkpoint past the newest one at that
    # restart was committed since (progress), so the budget is whole again (daemon/policies.py)
    control = Path(job["run_dir"]) / "control"
    newest = max(control.glob("agent-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    assert job["restarts"] == 1 and newest.stem != "agent-1"
    assert json.loads(newest.read_text())["max_restarts"] == 3

    n_starts = len([e for e in daemon.events("long") if e["kind"] == "start"])
    assert daemon.ctl("rollback", "long", str(first_ckpt)).returncode == 0
    daemon.wait_for("long", lambda j: j["state"] == "RUNNING" and len(
        [e for e in daemon.events("long") if e["kind"] == "start"]) > n_starts,
        "workers restarted for the rollback")
    starts = [e for e in daemon.events("long") if e["kind"] == "start"]
    assert starts[-1]["step"] == first_ckpt
    states = [e["to"] for e in daemon.events("long") if e["kind"] == "state"]
    assert states[-2:] == ["RECOVERING", "RUNNING"]

    assert daemon.ctl("stop", "long").returncode == 0
    job = daemon.wait_state("long", "STOPPED")
    assert "stopped" in job["message"]


def test_daemon_sigkill_and_restart_reattaches(daemon):
    assert daemon.ctl("start", "tiny", "--name", "survivor", "--steps", "100000").returncode == 0
    job = daemon.wait_for("survivor", lambda j: j["state"] == "RUNNING" and j["step"] >= 4,
                          "step 4")
    pid_file = daemon.state_dir / "jobs" / "survivor" / "control" / "agent-1.pid"
    agent_pid = json.loads(pid_file.read_text())["pid"]
    history = daemon.events("survivor")
    restarts_before = job["restarts"]  # the stand-in's crash at step 3, restarted by the agent

    daemon.kill()  # SIGKILL: no cleanup of any kind
    assert psutil.pid_exists(agent_pid), "the agent must outlive the daemon"
    daemon.start()

    job = daemon.job("survivor")
    assert job["state"] == "RUNNING"
    after = daemon.events("survivor")
    assert [e["seq"] for e in after[:len(history)]] == [e["seq"] for e in history]
    step_before = job["step"]
    job = daemon.wait_for("survivor", lambda j: j["step"] > step_before + 2,
                          "progress after the daemon restart")
    assert job["restarts"] == restarts_before, "reattached, not restarted"
    launches = [e for e in daemon.events("survivor") if e["kind"] == "launch"]
    assert len(launches) == 1

    assert daemon.ctl("stop", "survivor", "--now").returncode == 0
    daemon.wait_state("survivor", "STOPPED")
    assert not psutil.pid_exists(agent_pid) or \
        psutil.Process(agent_pid).status() == psutil.STATUS_ZOMBIE


def test_agent_killed_while_daemon_down_is_restarted(daemon):
    assert daemon.ctl("start", "tiny", "--name", "orphan", "--steps", "100000",
                      "--set", "checkpoint.interval=2").returncode == 0
    daemon.wait_for("orphan", lambda j: j["state"] == "RUNNING" and j["step"] >= 4, "step 4")
    pid_file = daemon.state_dir / "jobs" / "orphan" / "control" / "agent-1.pid"
    agent_pid = json.loads(pid_file.read_text())["pid"]
    restarts_before = daemon.job("orphan")["restarts"]
    daemon.kill()
    os.killpg(agent_pid, signal.SIGKILL)  # its workers (own sessions) are left behind
    deadline = time.monotonic() + 10
    while psutil.pid_exists(agent_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    daemon.start()
    daemon.wait_for("orphan", lambda j: j["restarts"] == restarts_before + 1
                          and j["state"] == "RUNNING", "relaunch from the checkpoint")
    faults = [e for e in daemon.events("orphan") if e["kind"] == "fault"]
    # the stand-in's crash at step 3 (restarted by the agent: a worker_exit fault naming it),
    # then the agent killed while the daemon was down
    assert [e["cause"] for e in faults] == ["worker_exit", "agent_exit"], faults
    assert "rank 0 failed first: exited with code 3" in faults[0]["message"], faults[0]
    worker_pids = {e["pid"] for e in _records(daemon, "orphan") if e["kind"] == "start"}
    assert len([p for p in worker_pids if psutil.pid_exists(p)]) == 1, "stray workers ended"
    assert daemon.ctl("stop", "orphan", "--now").returncode == 0
    daemon.wait_state("orphan", "STOPPED")


def _records(daemon, name):
    path = daemon.state_dir / "jobs" / name / "reports" / "rank-00000.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
