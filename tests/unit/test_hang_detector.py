"""The hang detector's timeouts: the step-derived one, and the start-up allowance of a worker
group the elastic agent restarted on its own (the job stays RUNNING while it imports and
restores; that silence is not a hang)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from ds3d.daemon.detectors import HangDetector
from ds3d.daemon.procs import WorkerTitle
from ds3d.daemon.reports import Observation
from ds3d.daemon.states import JobState


@dataclass
class _Job:
    run_dir: str
    agent_pid: int = 0
    state: JobState = JobState.RUNNING


def spawn_worker(run_dir: str, rank: int = 0) -> subprocess.Popen:
    """A process titled as a worker of `run_dir` (daemon/procs.py WorkerTitle), as a freshly
    restarted worker is."""
    title = str(WorkerTitle("ds3d.trainer.worker", run_dir, rank, rank))
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time, setproctitle; "
                             "setproctitle.setproctitle(sys.argv[1]); print('ready', flush=True); "
                             "time.sleep(60)", title], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def report_from(proc: subprocess.Popen) -> Observation:
    return Observation(records=[{"kind": "heartbeat", "rank": 0, "pid": proc.pid}],
                       last_seen={0: time.monotonic()})


@pytest.fixture
def workers():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def test_silence_past_the_timeout_is_a_hang():
    det = HangDetector(min_timeout_s=1.0, startup_s=1.0)
    job = _Job(run_dir="/nonexistent/job")  # no local workers: nothing to give an allowance for
    seen = {0: time.monotonic()}
    assert det.check(job, Observation(last_seen=seen), None) is None
    time.sleep(1.2)
    fault = det.check(job, Observation(last_seen=seen), None)
    assert fault is not None and fault.cause == "hang"
    assert "no report from any rank" in fault.message


def test_a_restarted_group_gets_its_start_up_allowance(workers, tmp_path):
    job = _Job(run_dir=str(tmp_path))
    long, short = HangDetector(min_timeout_s=1.0, startup_s=30.0), \
        HangDetector(min_timeout_s=1.0, startup_s=1.0)
    old = spawn_worker(job.run_dir)
    for det in (long, short):
        det.check(job, report_from(old), None)  # the old group's last report, then it died
    old.kill()
    old.wait()
    seen = {0: time.monotonic()}
    time.sleep(0.3)
    workers.append(spawn_worker(job.run_dir))  # the agent restarted the group
    time.sleep(1.2)  # past the step timeout: silent since the old group's last report
    assert long.check(job, Observation(last_seen=seen), None) is None  # still starting up
    fault = short.check(job, Observation(last_seen=seen), None)  # past its allowance
    assert fault is not None and "since it started" in fault.message


def test_a_group_that_reported_at_once_gets_the_step_timeout(workers, tmp_path):
    """Forked workers report within a fraction of a second of their start: the group counts as
    up by the pid of its report, not by how long after its start the report came."""
    job = _Job(run_dir=str(tmp_path))
    det = HangDetector(min_timeout_s=1.0, startup_s=300.0)
    workers.append(spawn_worker(job.run_dir))
    det.check(job, report_from(workers[-1]), None)  # the new group reported at once
    time.sleep(1.2)
    fault = det.check(job, Observation(), None)
    assert fault is not None and "no report from any rank" in fault.message


def test_a_new_group_is_not_taken_for_the_old_one_that_reported(workers, tmp_path):
    """Only a report from a live worker counts: the pids seen are pruned to the live workers
    (a pid the kernel reuses for a later group's process is not taken for one that reported)."""
    job = _Job(run_dir=str(tmp_path))
    det = HangDetector(min_timeout_s=1.0, startup_s=300.0)
    gone = spawn_worker(job.run_dir)
    det.check(job, report_from(gone), None)
    gone.kill()
    gone.wait()
    time.sleep(1.2)
    assert det.check(job, Observation(), None) is not None  # silence, no live worker: a hang
    workers.append(spawn_worker(job.run_dir))  # a new group that has not reported
    det._since = time.monotonic() - 2  # noqa: SLF001 - silent past the step timeout again
    assert det.check(job, Observation(), None) is None  # its start-up allowance


def test_reports_seen_before_the_job_ran_count(workers, tmp_path):
    """A forked group can start, train and save within one supervisor tick, all while the job is
    still STARTING, and be stopped (SIGSTOP) right after its first RUNNING tick: its reports
    from before still make it a group that reported, so its silence is a hang."""
    job = _Job(run_dir=str(tmp_path), state=JobState.STARTING)
    det = HangDetector(min_timeout_s=1.0, startup_s=300.0)
    workers.append(spawn_worker(job.run_dir))
    assert det.check(job, report_from(workers[-1]), None) is None  # STARTING: no verdict
    job.state = JobState.RUNNING
    assert det.check(job, Observation(), None) is None
    time.sleep(1.2)
    fault = det.check(job, Observation(), None)
    assert fault is not None and "no report from any rank" in fault.message
