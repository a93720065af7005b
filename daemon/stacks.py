"""Python stacks of a job's local worker processes, for the hang event.

Before the hang detector's fault kills a silent worker group, the supervisor asks every local
rank where it is stuck: `py-spy dump` when py-spy is installed (next to the daemon's Python or on
PATH), else SIGUSR1, on which each worker's `faulthandler` writes all thread stacks to its stderr
(trainer/worker.py); the agent redirects that stderr to RUN_DIR/logs/attempt-N/.../<local
rank>/stderr.log, from which the new bytes are read back.

A rank whose stack cannot be taken (stopped with SIGSTOP, stuck in the kernel, py-spy failing
and faulthandler writing nothing) is the first suspect: a process that cannot answer cannot
train either, and the others wait for it. It is named with its pid, host and why (`unanswered`).
Ranks whose stacks show no torch.distributed / pipeline-p2p frame are the next suspects: the
others wait in a collective for them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .procs import job_workers

# frames of a rank that is waiting on its peers (a collective or a pipeline send/recv)
_WAITING = ("distributed_c10d.py", "/pipe/p2p.py", "torch/distributed/")
# frames of torch's elastic machinery every worker has at the bottom of its stack (the entry's
# @record wrapper): not a sign of waiting
_NOT_WAITING = ("torch/distributed/elastic/",)
_MAX_STACK_CHARS = 12000


def _waiting(stack: str) -> bool:
    """A frame of the stack waits on a peer (a collective or a pipeline send/recv)."""
    return any(w in line and not any(n in line for n in _NOT_WAITING)
               for line in stack.splitlines() for w in _WAITING)


def local_workers(run_dir: Path) -> dict[int, tuple[int, int]]:
    """Global rank -> (pid, local rank) of the live worker processes of `run_dir`, from their
    process titles (procs.WorkerTitle)."""
    return {t.rank: (p.pid, t.local_rank) for p, t in job_workers(run_dir).items()}


def _py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def _stderr_log(run_dir: Path, attempt: int, local_rank: int) -> Path | None:
    logs = sorted((run_dir / "logs" / f"attempt-{attempt}").glob(f"*/attempt_*/{local_rank}/"
                                                                 "stderr.log"),
                  key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None


def _faulthandler_dumps(run_dir: Path, attempt: int, workers: dict[int, tuple[int, int]],
                        wait_s: float = 2.0) -> dict[int, str]:
    sizes: dict[int, tuple[Path, int]] = {}
    for rank, (pid, local) in workers.items():
        log = _stderr_log(run_dir, attempt, local)
        if log is None:
            continue
        sizes[rank] = (log, log.stat().st_size)
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            sizes.pop(rank)
    time.sleep(wait_s if sizes else 0)
    out = {}
    for rank, (log, size) in sizes.items():
        with open(log, "rb") as fh:
            fh.seek(size)
            text = fh.read().decode(errors="replace")
        if text.strip():
            out[rank] = "faulthandler (SIGUSR1):\n" + text[-_MAX_STACK_CHARS:]
    return out


@dataclass
class StackDump:
    """What asking the local ranks for their stacks gave."""

    stacks: dict[int, str] = field(default_factory=dict)  # rank -> stack text
    method: str = ""  # "py-spy" | "faulthandler" | "" (none taken)
    # rank -> {"pid", "host", "why"} for each local rank whose stack could not be taken
    unanswered: dict[int, dict[str, object]] = field(default_factory=dict)


_NOT_RUNNING = {psutil.STATUS_STOPPED: "the process is stopped (SIGSTOP/SIGTSTP)",
                psutil.STATUS_TRACING_STOP: "the process is stopped by a tracer",
                psutil.STATUS_DISK_SLEEP: "the process is in uninterruptible sleep (D: I/O)",
                psutil.STATUS_ZOMBIE: "the process has exited (zombie)"}


# not asked at all: they cannot answer until someone else acts (py-spy would wait on them);
# a process in uninterruptible sleep may be in a short disk wait, so it is asked like the others
_UNASKABLE = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE)


def _state(pid: int, unaskable_only: bool = False) -> str:
    """Why a process cannot answer, from its state in /proc ('' when it is running/sleeping,
    or, with `unaskable_only`, when it may still answer)."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return "the process is gone"
    if unaskable_only and status not in _UNASKABLE:
        return ""
    return _NOT_RUNNING.get(status, "")


def dump_stacks(run_dir: Path, attempt: int, timeout_s: float = 10.0,
                host: str | None = None) -> StackDump:
    """The stack of every local worker of `run_dir`; a rank whose stack cannot be taken is in
    `unanswered` with its pid, `host` (default: this machine's name) and why. A stopped or
    exited process is not asked (py-spy would wait on it for `timeout_s`)."""
    workers = local_workers(run_dir)
    dump = StackDump()
    if not workers:
        return dump
    host = host or socket.gethostname()
    why: dict[int, str] = {}
    for rank, (pid, _local) in workers.items():
        if (state := _state(pid, unaskable_only=True)):
            why[rank] = state
    askable = {r: w for r, w in workers.items() if r not in why}
    spy = _py_spy()
    if spy and askable:
        procs = {rank: subprocess.Popen([spy, "dump", "--pid", str(pid)],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for rank, (pid, _local) in askable.items()}
        deadline = time.monotonic() + timeout_s
        for rank, proc in procs.items():
            try:
                text, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                why[rank] = f"py-spy did not answer within {timeout_s:.0f} s"
                continue
            out = text.decode(errors="replace")
            if proc.returncode == 0 and out.strip():
                dump.stacks[rank] = "py-spy dump:\n" + out[-_MAX_STACK_CHARS:]
            else:
                last = out.strip().splitlines()[-1][:200] if out.strip() else "no output"
                why[rank] = f"py-spy failed (exit {proc.returncode}: {last})"
    missing = {r: w for r, w in askable.items() if r not in dump.stacks}
    if missing:
        dump.stacks.update(_faulthandler_dumps(run_dir, attempt, missing))
    for rank, (pid, _local) in workers.items():
        if rank in dump.stacks:
            why.pop(rank, None)
            continue
        reason = why.get(rank) or _state(pid) or "py-spy unavailable"
        if rank in missing:
            reason += "; faulthandler (SIGUSR1) wrote nothing"
        dump.unanswered[rank] = {"pid": pid, "host": host, "why": reason}
    by_spy = [r for r, t in dump.stacks.items() if t.startswith("py-spy")]
    dump.method = ("py-spy" if by_spy else "faulthandler") if dump.stacks else ""
    return dump


def suspects(dump: StackDump) -> list[int]:
    """The suspect ranks, first suspect first: those that did not answer, then those whose
    stacks are not waiting on a peer (no collective / p2p frame)."""
    quiet = sorted(r for r, text in dump.stacks.items() if not _waiting(text))
    return sorted(dump.unanswered) + quiet
