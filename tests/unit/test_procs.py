"""A process is known again by pid and start time, and a move of the boot time does not make
the daemon's own agent a stranger (it was then never stopped, and two worker groups ran)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ds3d.daemon.procs import ProcessRef, same_start

pytestmark = pytest.mark.timeout(30)


def test_same_start_allows_rounding_and_whole_second_boot_time_moves():
    t = 1_796_408_347.77
    assert same_start(t, t) and same_start(t, t + 0.01)
    assert same_start(t, t + 1.0) and same_start(t, t - 2.02)  # btime moved by 1 or 2 s
    assert not same_start(t, t + 0.5)  # another process, started half a second apart
    assert not same_start(t, t + 3.0)  # beyond the drift accepted
    assert not same_start(t, t + 1.3)


def test_a_ref_with_a_shifted_start_is_still_alive_and_a_wrong_one_is_not():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = psutil.Process(proc.pid).create_time()
        assert ProcessRef(proc.pid, started).alive()
        assert ProcessRef(proc.pid, started - 1.0).alive()  # read before btime moved by 1 s
        assert not ProcessRef(proc.pid, started - 0.5).alive()
    finally:
        proc.kill()
        proc.wait()
    assert not ProcessRef(proc.pid, started).alive()


def test_a_worker_title_round_trips_through_the_command_line_psutil_reads(tmp_path):
    """A forked worker's title is its whole command line: psutil returns it as one element
    padded with empty strings; a run dir with spaces still parses; other processes do not."""
    import subprocess
    import sys

    from ds3d.daemon.procs import WorkerTitle, job_workers

    run_dir = tmp_path / "a job dir"
    title = WorkerTitle("ds3d.trainer.worker", str(run_dir), rank=12, local_rank=3)
    assert WorkerTitle.parse([str(title), "", ""]) == title
    assert WorkerTitle.parse(["python", "-m", "ds3d.trainer.worker", "--run-dir", "x"]) is None
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time, setproctitle; "
                             "setproctitle.setproctitle(sys.argv[1]); print('ok', flush=True); "
                             "time.sleep(30)", str(title)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ok"
        [(p, seen)] = job_workers(run_dir).items()
        assert p.pid == proc.pid and seen == title
        assert job_workers(tmp_path / "another job") == {}
        assert list(job_workers(tmp_path, below=True)) == [p]  # a root of several nodes' jobs
        assert job_workers(tmp_path) == {}  # not the job itself without `below`
        assert job_workers(str(run_dir)[:-1], below=True) == {}  # a name prefix is not a folder
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("adopted", [False, True], ids=["started_here", "adopted"])
def test_an_agent_lingering_after_its_result_is_done_with_its_code(tmp_path, monkeypatch,
                                                                     adopted):
    """An agent that wrote its result file but does not exit (stuck in interpreter teardown)
    is running for AGENT_EXIT_GRACE_S, then killed and reported with the recorded code: the
    finished job must not look hung. Without a result file a live agent is running, however
    long (a real process, started in its own session as the launcher starts agents)."""
    import json

    from ds3d.daemon import launcher
    from ds3d.daemon.launcher import AgentHandle
    from ds3d.daemon.procs import spawn_detached

    monkeypatch.setattr(launcher, "AGENT_EXIT_GRACE_S", 1.0)
    result = tmp_path / "agent-1.exit"
    script = ("import json, sys, time; time.sleep(float(sys.argv[2])); "
              "open(sys.argv[1], 'w').write(json.dumps({'exit_code': 3})); time.sleep(60)")
    popen, ref = spawn_detached([sys.executable, "-c", script, str(result), "1.5"],
                                tmp_path / "agent.log", dict(os.environ), tmp_path)
    agent = AgentHandle(ref, result, None if adopted else popen)
    try:
        assert agent.poll() is None  # no result yet
        while not result.exists():
            assert popen.poll() is None
            time.sleep(0.05)
        assert json.loads(result.read_text())["exit_code"] == 3
        assert agent.poll() is None  # within the grace: it may still exit by itself
        time.sleep(1.2)
        assert agent.poll() == 3
        assert popen.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL) and not ref.alive()
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()


def test_killing_a_group_leaves_its_exit_status_to_the_parent(tmp_path):
    """kill_group waited with psutil.wait_procs, which reaps the caller's own children: the
    Popen of an agent ds3dd had SIGKILLed then read ECHILD and reported exit code 0."""
    from ds3d.daemon.procs import kill_group, spawn_detached

    popen, ref = spawn_detached([sys.executable, "-c", "import time; time.sleep(60)"],
                                tmp_path / "child.log", dict(os.environ), tmp_path)
    assert kill_group(ref.pid) == [ref.pid] and not ref.alive()
    assert popen.wait(timeout=10) == -signal.SIGKILL
