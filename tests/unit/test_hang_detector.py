"""The hang detector's timeouts: the step-derived one, and the start-up allowance of a worker
group the elastic agent restarted on its own (the job stays RUNNING while it imports and
restores; that silence is not a hang)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from ds3d.daemon.detectors import HangDetector
from ds3d.daemon.reports import Observation
from ds3d.daemon.states import JobState


@dataclass
class _Job:
    agent_pid: int = 0
    state: JobState = JobState.RUNNING


def spawn_worker() -> subprocess.Popen:
    """A child of this process, as a freshly restarted worker is a child of the agent."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.fixture
def workers():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_silence_past_the_timeout_is_a_hang():
    det = HangDetector(min_timeout_s=1.0, startup_s=1.0)
    job = _Job(agent_pid=0)  # no local agent: nothing to give an allowance for
    seen = {0: time.monotonic()}
    assert det.check(job, Observation(last_seen=seen), None) is None
    time.sleep(1.2)
    fault = det.check(job, Observation(last_seen=seen), None)
    assert fault is not None and fault.cause == "hang"
    assert "no report from any rank" in fault.message


def test_a_restarted_group_gets_its_start_up_allowance(workers):
    job = _Job(agent_pid=os.getpid())
    long, short = HangDetector(min_timeout_s=1.0, startup_s=30.0), \
        HangDetector(min_timeout_s=1.0, startup_s=1.0)
    seen = {0: time.monotonic()}  # the old group's last report, then it died
    for det in (long, short):
        det.check(job, Observation(last_seen=seen), None)
    time.sleep(0.3)
    workers.append(spawn_worker())  # the agent restarted the group
    time.sleep(1.2)  # past the step timeout: silent since the old group's last report
    assert long.check(job, Observation(last_seen=seen), None) is None  # still starting up
    fault = short.check(job, Observation(last_seen=seen), None)  # past its allowance
    assert fault is not None and "since it started" in fault.message


def test_a_group_that_reported_since_it_started_gets_the_step_timeout(workers):
    job = _Job(agent_pid=os.getpid())
    det = HangDetector(min_timeout_s=1.0, startup_s=300.0)
    workers.append(spawn_worker())
    time.sleep(2.5)  # imports, rendezvous, restore
    seen = {0: time.monotonic()}  # the new group reported
    det.check(job, Observation(last_seen=seen), None)
    time.sleep(1.2)
    fault = det.check(job, Observation(last_seen=seen), None)
    assert fault is not None and "no report from any rank" in fault.message
