"""A daemon restarted while its job runs picks up the hang detector's and the incident clock's
state from the workers' report files: the silence counts from the newest report on disk, the
running group is one that reported (its pids are in the reports: no start-up allowance), the
step times set the timeout, and a recovery counts the steps lost from rank 0's newest step.

Real processes titled as workers (daemon/procs.py WorkerTitle) stand in for the running group;
a fresh HangDetector / IncidentClock is what a restarted ds3dd builds."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from test_hang_detector import _Job, spawn_worker, workers  # noqa: F401 - fixture

from ds3d.daemon.detectors import HangDetector, ReportsOnDisk
from ds3d.daemon.incidents import IncidentClock
from ds3d.daemon.reports import Observation
from ds3d.daemon.states import JobState


def write_reports(run_dir: Path, pid: int, steps: range, step_time_s: float,
                  age_s: float, rank: int = 0, segment: str = "") -> Path:
    """The report file a worker `pid` wrote up to `age_s` ago: a start, then a step (rank 0)
    and a heartbeat per step."""
    path = run_dir / "reports" / f"rank-{rank:05d}{segment}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time() - age_s - len(steps) * step_time_s
    base = {"rank": rank, "restart": 0, "node": "n", "pid": pid}
    lines = [{"kind": "start", "time": t0, "step": steps[0] - 1, **base}]
    for i, n in enumerate(steps):
        t = t0 + (i + 1) * step_time_s
        if rank == 0:
            lines.append({"kind": "step", "time": t, "step": n, "step_time_s": step_time_s,
                          "loss": 1.0, **base})
        lines.append({"kind": "heartbeat", "time": t, "step": n, "phase": "train", **base})
    with open(path, "a") as fh:
        fh.writelines(json.dumps(rec) + "\n" for rec in lines)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def caught_up() -> Observation:
    """The restarted daemon's first poll: it read the records its predecessor had not stored
    yet, and stamped them (ReportTail.last_seen) with its own clock."""
    return Observation(last_seen={0: time.monotonic()})


def test_a_hang_in_progress_is_declared_from_the_newest_report_on_disk(workers, tmp_path):  # noqa: F811
    job = _Job(run_dir=str(tmp_path))
    workers.append(spawn_worker(job.run_dir))  # the running group: it reported, then stopped
    write_reports(tmp_path, workers[-1].pid, range(1, 84), step_time_s=0.01, age_s=5.0)
    det = HangDetector(min_timeout_s=1.0, startup_s=600.0)  # what the restarted daemon builds
    fault = det.check(job, caught_up(), None)
    assert fault is not None and fault.cause == "hang", fault
    # silent since the newest report (5 s ago), not since this daemon started; not taken for a
    # group the agent restarted (no start-up allowance of 600 s from the workers' start)
    assert fault.message.startswith("no report from any rank for 5 s (timeout 1 s)"), fault


def test_the_step_times_on_disk_set_the_timeout(workers, tmp_path):  # noqa: F811
    job = _Job(run_dir=str(tmp_path))
    workers.append(spawn_worker(job.run_dir))
    write_reports(tmp_path, workers[-1].pid, range(1, 30), step_time_s=0.5, age_s=5.0)
    det = HangDetector(min_timeout_s=1.0, startup_s=600.0)
    assert det.check(job, caught_up(), None) is None  # 5 s < 20 x 0.5 s
    assert det.timeout_s() == pytest.approx(10.0)


def test_reports_after_the_restart_are_signs_of_life(workers, tmp_path):  # noqa: F811
    """Only the catch-up read is discounted: a report polled after the daemon's first look
    restarts the silence as ever."""
    job = _Job(run_dir=str(tmp_path))
    workers.append(spawn_worker(job.run_dir))
    write_reports(tmp_path, workers[-1].pid, range(1, 10), step_time_s=0.01, age_s=0.5)
    det = HangDetector(min_timeout_s=1.0, startup_s=600.0)
    assert det.check(job, caught_up(), None) is None
    time.sleep(0.8)
    alive = caught_up()  # a new report, polled after the first check
    assert det.check(job, alive, None) is None  # 1.3 s since the disk's, 0 since this one
    time.sleep(0.5)
    assert det.check(job, alive, None) is None  # still within 1 s of the new report
    time.sleep(0.7)
    fault = det.check(job, alive, None)
    assert fault is not None and "no report from any rank for 1 s" in fault.message, fault


def test_a_group_restarted_by_the_agent_keeps_its_start_up_allowance(workers, tmp_path):  # noqa: F811
    """The pids on disk are the old group's: the new group that has not reported yet is still
    starting up, also for a daemon that restarted meanwhile."""
    job = _Job(run_dir=str(tmp_path))
    old = spawn_worker(job.run_dir)
    write_reports(tmp_path, old.pid, range(1, 10), step_time_s=0.01, age_s=5.0)
    old.kill()
    old.wait()
    workers.append(spawn_worker(job.run_dir))  # the agent's new group, silent so far
    det = HangDetector(min_timeout_s=1.0, startup_s=600.0)
    assert det.check(job, caught_up(), None) is None
    short = HangDetector(min_timeout_s=1.0, startup_s=1.0)
    time.sleep(1.1)
    fault = short.check(job, caught_up(), None)
    assert fault is not None and "since it started" in fault.message, fault


def test_a_job_not_running_at_the_restart_is_timed_from_its_launch(workers, tmp_path):  # noqa: F811
    """Old reports (a paused job's) say nothing of a group launched later."""
    job = _Job(run_dir=str(tmp_path), state=JobState.PAUSED)
    workers.append(spawn_worker(job.run_dir))
    write_reports(tmp_path, workers[-1].pid, range(1, 10), step_time_s=0.01, age_s=60.0)
    det = HangDetector(min_timeout_s=1.0, startup_s=600.0)
    assert det.check(job, caught_up(), None) is None
    job.state = JobState.RUNNING
    assert det.check(job, Observation(), None) is None


def test_reports_on_disk_reads_the_newest_segments_tails(tmp_path):
    write_reports(tmp_path, 111, range(1, 50), step_time_s=0.2, age_s=30.0)
    write_reports(tmp_path, 222, range(50, 84), step_time_s=0.1, age_s=3.0, segment=".000001")
    write_reports(tmp_path, 333, range(50, 84), step_time_s=0.1, age_s=2.0, rank=1)
    other = tmp_path / "reports" / "nodes" / "peer"
    other.mkdir(parents=True)
    write_reports(tmp_path, 444, range(50, 60), step_time_s=0.1, age_s=1.0, rank=2)
    (tmp_path / "reports" / "rank-00002.jsonl").rename(other / "rank-00002.jsonl")
    disk = ReportsOnDisk.read(tmp_path, tail_bytes=2000)  # a few records of each file's end
    assert disk.pids == {222, 333}  # rank 0's newest segment, rank 1; not the other node's
    assert disk.last_step is not None and disk.last_step[0] == 83
    assert disk.step_times and set(disk.step_times) == {0.1}
    assert disk.newest_write == pytest.approx(time.time() - 1.0, abs=0.5)
    assert ReportsOnDisk.read(tmp_path / "nothing") == ReportsOnDisk()


def test_the_incident_clock_of_a_restarted_daemon_counts_the_steps_trained(tmp_path):
    write_reports(tmp_path, 222, range(1, 84), step_time_s=0.1, age_s=3.0)
    clock = IncidentClock.resumed(str(tmp_path), step=80)  # the store lags the reports
    assert clock.last_step == 83
    clock.fault("hang", now=time.time())
    assert clock.observe([{"kind": "start", "step": 50, "time": time.time() + 1, "rank": 0,
                           "restart": 0}]) == []
    [inc] = clock.observe([{"kind": "step", "step": 51, "time": time.time() + 2, "rank": 0}])
    assert inc.steps_lost == 33 and "33 step(s) trained again" in inc.message(), inc
    assert inc.time_to_detect_s == pytest.approx(3.0, abs=0.5)
    # no step record on disk: the job's stored step, time unknown
    assert IncidentClock.resumed(str(tmp_path / "none"), step=7).last_step == 7
    assert IncidentClock.resumed(str(tmp_path / "none"), step=0).last_step == -1
