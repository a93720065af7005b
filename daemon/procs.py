"""Knowing a process again after a daemon restart: pid *and* start time; and ending it.

Why both: ds3dd may be SIGKILLed and restarted while the agents and the rendezvous store it
started keep running in their own sessions. A pid alone is not an identity — after a reboot or
enough forks another process may carry it — so the daemon stores the kernel's start time with
the pid and treats a process as "ours" only if both match.

Ending a process group spares multiprocessing's resource tracker (`kill_group`). An agent runs
its workers through torch elastic's MultiprocessContext with the "forkserver" start method,
whose Event and per-rank SimpleQueues are named POSIX semaphores, `/dev/shm/sem.mp-*`. With
that start method they are not unlinked at creation: the object's finalizer unlinks each (a
clean exit), and otherwise the resource tracker, a process the agent starts in the agent's
process group, which ignores SIGTERM and SIGINT and unlinks whatever is still registered once
every process holding its pipe (agent, forkserver, workers) is gone. A SIGKILL of the whole
group took the tracker too, and the files stayed until reboot: several per agent and restart,
in a long run with restarts without bound (tmpfs inodes and pages on every node). A group
SIGKILLed whole from elsewhere: daemon/semaphores.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

# The kernel reports start time in clock ticks since boot; psutil adds the boot time (/proc/stat
# `btime`, whole seconds), which moves by whole seconds when the wall clock is adjusted (NTP on a
# VM). Two reads of one process then differ by whole seconds plus rounding, and an exact match
# would take the daemon's own agent for a stranger: it would never be stopped, and a restart
# would run two worker groups (the likeliest cause of a CI run where an agent outlived its kill).
_START_TIME_SLACK_S = 0.05
_BOOT_TIME_DRIFT_S = 2  # whole seconds of btime movement accepted between two reads


def same_start(a: float, b: float) -> bool:
    """Two psutil create_time() reads of one process: equal up to rounding and a whole-second
    move of the boot time."""
    d = abs(a - b)
    return d <= _BOOT_TIME_DRIFT_S + _START_TIME_SLACK_S and abs(d - round(d)) <= \
        _START_TIME_SLACK_S


@dataclass(frozen=True)
class ProcessRef:
    pid: int
    started: float  # psutil create_time(): unix seconds

    def alive(self) -> bool:
        """The same process (pid and start time) exists and has not exited (zombies count as
        gone: they are only waiting to be reaped)."""
        if self.pid <= 0:
            return False
        try:
            p = psutil.Process(self.pid)
            if not same_start(p.create_time(), self.started):
                return False
            return bool(p.status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            return False

    def signal_group(self, sig: signal.Signals) -> bool:
        """Signals the process group the process leads (it was started in its own session);
        False if it is gone or not ours."""
        if not self.alive():
            return False
        try:
            os.killpg(self.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def terminate(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the group, then SIGKILL after `grace_s`; returns when it is gone. A
        SIGCONT follows the SIGTERM: a stopped process of the group acts on it at once instead
        of sitting out the grace."""
        if not self.signal_group(signal.SIGTERM):
            return
        self.signal_group(signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not self.alive():
                return
            time.sleep(0.1)
        if self.alive():
            kill_group(self.pid)
        deadline = time.monotonic() + 5
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)


# The command line multiprocessing starts its resource tracker with (CPython 3.8 to 3.13:
# resource_tracker.ensure_running runs `python -c '<this>;main(FD)'`)
_RESOURCE_TRACKER = "from multiprocessing.resource_tracker import main"


def is_resource_tracker(p: psutil.Process) -> bool:
    """`p` is a multiprocessing resource tracker (module docstring)."""
    try:
        return any(_RESOURCE_TRACKER in arg for arg in p.cmdline())
    except psutil.Error:
        return False


def kill_group(pgid: int, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL to every process of the process group `pgid` except multiprocessing's resource
    trackers, which end by themselves once the others are gone, after unlinking what they left
    (module docstring). Repeated until none is left (a forkserver may fork one more while the
    first kills land) or `timeout_s` passes. Returns the pids killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        members = [p for p in group_members(pgid) if not is_resource_tracker(p)]
        if not members or time.monotonic() > deadline:
            return sorted(killed)
        for p in members:
            try:
                p.kill()
                killed.add(p.pid)
            except psutil.NoSuchProcess:
                pass
        wait_gone(members, timeout_s=0.5)


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> None:
    """Waits until each of `procs` has exited (a zombie counts), without reaping any: unlike
    psutil.wait_procs, which reaps the caller's own children with waitpid, so that their Popen
    then read ECHILD and took it for exit code 0 (an agent SIGKILLed by ds3dd "exited 0")."""
    deadline = time.monotonic() + timeout_s
    while any(map(_running, procs)) and time.monotonic() < deadline:
        time.sleep(0.02)


def _running(p: psutil.Process) -> bool:
    """`p` has not exited (a zombie has: it only waits to be reaped)."""
    try:
        return bool(p.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def group_members(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of process group `pgid`."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info.get("status") != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def spawn_detached(argv: Sequence[str], log_path: Path, env: dict[str, str],
                   cwd: Path) -> tuple[subprocess.Popen[bytes], ProcessRef]:
    """Starts `argv` in a new session (SIGKILL of the daemon, or Ctrl-C in its terminal, does
    not reach it), stdout+stderr appended to `log_path`. Returns the Popen (to reap it while
    this daemon lives) and its durable identity."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True, close_fds=True)
    return proc, ProcessRef(proc.pid, psutil.Process(proc.pid).create_time())


# Workers are forked from a forkserver (daemon/agent.py), so their command line is the
# forkserver's. Each worker sets its process title to this, which `ps` shows and by which the
# daemon finds a job's workers (stacks, strays): RUN_DIR may contain spaces, hence the regex.
_WORKER_TITLE = "ds3d-worker {module} --run-dir {run_dir} --rank {rank} --local-rank {local_rank}"
_WORKER_TITLE_RE = re.compile(
    r"^ds3d-worker (?P<module>\S+) --run-dir (?P<run_dir>.+) --rank (?P<rank>\d+) "
    r"--local-rank (?P<local_rank>\d+)$")


@dataclass(frozen=True)
class WorkerTitle:
    """What a worker's process title says: its job (run dir), module and ranks."""

    module: str
    run_dir: str
    rank: int
    local_rank: int

    def __str__(self) -> str:
        return _WORKER_TITLE.format(module=self.module, run_dir=self.run_dir, rank=self.rank,
                                    local_rank=self.local_rank)

    @classmethod
    def parse(cls, cmdline: Sequence[str]) -> WorkerTitle | None:
        """The title in a process's command line (psutil returns a set title as one element,
        padded with empty strings), or None for any other process."""
        m = _WORKER_TITLE_RE.match(" ".join(cmdline).strip())
        if m is None:
            return None
        return cls(m["module"], m["run_dir"], int(m["rank"]), int(m["local_rank"]))


def job_workers(run_dir: Path | str, *, below: bool = False) -> dict[psutil.Process, WorkerTitle]:
    """The live worker processes of the job in `run_dir`, with what their titles say;
    `below`: of every job run anywhere under `run_dir` (a test's root of several nodes)."""
    target = str(run_dir)
    out: dict[psutil.Process, WorkerTitle] = {}
    for p in psutil.process_iter(["cmdline", "status"]):
        title = WorkerTitle.parse(p.info.get("cmdline") or [])
        if title is None or p.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        if title.run_dir == target or (below and title.run_dir.startswith(target + os.sep)):
            out[p] = title
    return out


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM or SIGINT sets: how ds3d's helper processes (the rendezvous store,
    the leadership drill) end their loops cleanly when the daemon or a test stops them."""
    stop = threading.Event()

    def _set(_sig: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _set)
    signal.signal(signal.SIGINT, _set)
    return stop


def exit_without_teardown(code: int) -> None:
    """Ends a helper process that imported torch (the agent, the rendezvous store) once its
    work is recorded, skipping the interpreter's teardown: with torch imported that is one
    long garbage collection of the whole heap (3.7-8.8 s measured on the 2-core VM beside
    other work, 15 s and more in a CI run), during which ds3dd sees a process that has
    finished but still runs (an agent's workers' silence then read as a hang; a store's stop
    waited out its grace). Logging and stdio are flushed; multiprocessing's resource tracker
    and a forkserver end by themselves when this process's pipes close."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
