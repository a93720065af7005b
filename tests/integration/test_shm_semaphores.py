"""No named semaphore of a job outlives it in /dev/shm.

An agent's torch elastic MultiprocessContext ("forkserver" start method) holds an Event and a
SimpleQueue per rank: named POSIX semaphores, /dev/shm/sem.mp-*, unlinked by their finalizers on
a clean exit and otherwise by multiprocessing's resource tracker, a process of the agent's
group. A SIGKILL of the whole group took the tracker too, and the group's files stayed for good:
ds3dd's own, past the grace of a kill (procs.kill_group now spares the tracker), or one from
outside (ds3dd now unlinks what the agent recorded: daemon/semaphores.py).

The job test runs the real ds3dd, agent and forkserver, with the stand-in worker deaf to
commands, SIGTERM and SIGINT (a hung worker, as far as ds3dd can tell): an agent restart, a
daemon restart, the agent's group SIGKILLed from outside and relaunched, and `stop --now`. The
semaphores counted are exactly the job's: the files mapped by the agent and its children (by
inode in /proc/PID/maps, which names the file by the temporary name glibc created it under), so
that other tests creating and removing semaphores in parallel neither hide a leak nor fake one.

Heavy: `flock /tmp/ds3d-heavy.lock .venv/bin/pytest tests/integration/test_shm_semaphores.py`."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from ds3d.daemon.procs import group_members, spawn_detached
from ds3d.daemon.semaphores import mapped_semaphores

from test_daemon_support import FAKE_WORKER, DaemonProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SHM = Path("/dev/shm")

COMMAND_FILE = '"control" / "command.json"'
assert COMMAND_FILE in FAKE_WORKER
STUBBORN_WORKER = (  # SIGINT: what a worker gets when its forkserver dies (PR_SET_PDEATHSIG)
    "import signal\nfor s in (signal.SIGTERM, signal.SIGINT):\n    signal.signal(s, "
    "signal.SIG_IGN)  # only SIGKILL ends it\n"
    + FAKE_WORKER.replace(COMMAND_FILE, '"control" / "none"'))


def _semaphores() -> dict[int, str]:
    """inode -> name of every multiprocessing semaphore in /dev/shm now."""
    return {e.inode(): e.name for e in os.scandir(SHM) if e.name.startswith("sem.mp-")}


class JobSemaphores:
    """The (name, inode) of every semaphore the job's agents and their children map, sampled
    every 0.1 s while the job runs (a group's semaphores live as long as it does)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.seen: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _tree(self) -> set[int]:
        pids: set[int] = set()
        for pid_file in self.run_dir.glob("control/agent-*.pid"):
            try:
                agent = psutil.Process(json.loads(pid_file.read_text())["pid"])
                pids |= {agent.pid, *(c.pid for c in agent.children(recursive=True))}
            except (psutil.Error, ValueError, OSError):
                continue
        return pids

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            inodes = set()
            for pid in self._tree():
                try:
                    with open(f"/proc/{pid}/maps") as fh:
                        inodes |= {int(line.split()[4]) for line in fh
                                   if f" {SHM}/sem." in line}
                except (OSError, ValueError, IndexError):
                    continue
            if inodes:
                names = _semaphores()
                self.seen |= {(names[i], i) for i in inodes if i in names}

    def left(self, of: set[tuple[str, int]] | None = None) -> list[str]:
        """The job's semaphores (or those of `of`) still in /dev/shm (same name and inode)."""
        now = _semaphores()
        return sorted(name for name, inode in (self.seen if of is None else of)
                      if now.get(inode) == name)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _wait_gone(sems: JobSemaphores, of: set[tuple[str, int]] | None = None,
               timeout_s: float = 30.0) -> list[str]:
    """The tracker unlinks once the last process of the group is gone: moments, not at once."""
    deadline = time.monotonic() + timeout_s
    while (left := sems.left(of)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_a_killed_and_restarted_job_leaves_no_semaphore(tmp_path: Path) -> None:
    worker_dir = tmp_path / "worker"
    worker_dir.mkdir()
    (worker_dir / "ds3d_stubborn_worker.py").write_text(STUBBORN_WORKER)
    with DaemonProc(tmp_path / "state",
                    extra_env={"FAKE_STEP_S": "0.25", "FAKE_CRASH_AT_STEP": "3",
                               "PYTHONPATH": f"{worker_dir}:{os.environ.get('PYTHONPATH', '')}"},
                    args=["--worker-module", "ds3d_stubborn_worker"]) as daemon:
        assert daemon.ctl("start", "tiny", "--name", "j", "--steps", "100000",
                          "--set", "checkpoint.interval=2").returncode == 0
        run_dir = daemon.state_dir / "jobs" / "j"
        sems = JobSemaphores(run_dir)
        try:
            # the stand-in exits at step 3 once: the agent starts a second group
            daemon.wait_for("j", lambda j: j["restarts"] >= 1 and j["step"] >= 5,
                            "step 5 after the agent's restart")
            daemon.kill()  # a daemon crash does not touch the agent: it reattaches
            daemon.start()
            daemon.wait_for("j", lambda j: j["step"] >= 7, "step 7 after the daemon restart")
            assert len(sems.seen) >= 7, sems.seen  # an Event (5), a queue (2) per group start
            restarts = daemon.job("j")["restarts"]

            # the agent's whole group SIGKILLed from outside (kill -9 -PGID): its resource
            # tracker too; ds3dd starts the job again
            agent = json.loads((run_dir / "control" / "agent-1.pid").read_text())["pid"]
            time.sleep(0.3)  # one more sample of the running group
            killed = set(sems.seen)
            os.killpg(agent, signal.SIGKILL)
            daemon.wait_for("j", lambda j: j["restarts"] > restarts and j["state"] == "RUNNING"
                            and (run_dir / "control" / "agent-2.pid").exists(), "the relaunch")
            left = _wait_gone(sems, killed)
            assert left == [], f"left by the killed group: {left} of {sorted(killed)}"

            daemon.wait_for("j", lambda j: len(sems.seen) > len(killed), "the new group")
            assert daemon.ctl("stop", "j", "--now").returncode == 0  # the stand-in ignores it
            daemon.wait_state("j", "STOPPED", timeout_s=60)
            sems.close()
            left = _wait_gone(sems)
            assert left == [], f"{len(left)} of the job's {len(sems.seen)} semaphores are " \
                f"still in {SHM} after it stopped: {left}"
        finally:
            sems.close()


TREE = """
import multiprocessing, signal, sys, time
def child(event):
    event.wait()
if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an agent that does not end in the grace
    ctx = multiprocessing.get_context("forkserver")
    event, queue = ctx.Event(), ctx.SimpleQueue()
    ctx.Process(target=child, args=(event,)).start()
    print("ready", flush=True)
    time.sleep(600)
"""


def test_terminate_past_its_grace_spares_the_resource_tracker(tmp_path: Path) -> None:
    """ProcessRef.terminate's SIGKILL of a group (an agent that did not end in its grace):
    the group's resource tracker is spared and unlinks the group's semaphores itself."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    proc, ref = spawn_detached([sys.executable, str(script)], tmp_path / "tree.log", dict(
        os.environ), tmp_path)
    deadline = time.monotonic() + 60
    while "ready" not in (tmp_path / "tree.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, \
            (tmp_path / "tree.log").read_text()
        time.sleep(0.1)
    mine = mapped_semaphores(ref.pid)
    assert len(mine) == 7, mine  # the Event's 5 and the queue's 2
    ref.terminate(grace_s=0.5)
    proc.wait(5)
    deadline = time.monotonic() + 30
    now = _semaphores()
    while any(now.get(inode) == name for name, inode in mine.items()):
        assert time.monotonic() < deadline, f"left: {sorted(mine)}"
        time.sleep(0.1)
        now = _semaphores()
    while group_members(ref.pid):  # the tracker ends too, once it has unlinked them
        assert time.monotonic() < deadline, group_members(ref.pid)
        time.sleep(0.1)
