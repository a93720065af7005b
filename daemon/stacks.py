"""Python stacks of a job's local worker processes, for the hang event.

Before the hang detector's fault kills a silent worker group, the supervisor asks every local
rank where it is stuck: `py-spy dump` when py-spy is installed (next to the daemon's Python or on
PATH), else SIGUSR1, on which each worker's `faulthandler` writes all thread stacks to its stderr
(trainer/worker.py); the agent redirects that stderr to RUN_DIR/logs/attempt-N/.../<local
rank>/stderr.log, from which the new bytes are read back.

Ranks whose stacks show no torch.distributed / pipeline-p2p frame are the suspects: the others
wait in a collective for them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

# frames of a rank that is waiting on its peers (a collective or a pipeline send/recv)
_WAITING = ("distributed_c10d.py", "/pipe/p2p.py", "torch/distributed/")
_MAX_STACK_CHARS = 12000


def local_workers(run_dir: Path) -> dict[int, tuple[int, int]]:
    """Global rank -> (pid, local rank) of the live worker processes of `run_dir`, from the
    RANK/LOCAL_RANK the agent put in their environment."""
    target = str(run_dir)
    out: dict[int, tuple[int, int]] = {}
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = p.info.get("cmdline") or []
        if "--run-dir" not in cmd or "ds3d.daemon.agent" in cmd or \
                p.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        i = cmd.index("--run-dir")
        if i + 1 >= len(cmd) or cmd[i + 1] != target:
            continue
        try:
            env = p.environ()
            out[int(env["RANK"])] = (p.info["pid"], int(env.get("LOCAL_RANK", 0)))
        except (psutil.Error, KeyError, ValueError):
            continue
    return out


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


def dump_stacks(run_dir: Path, attempt: int, timeout_s: float = 20.0) -> tuple[dict[int, str], str]:
    """Rank -> stack text of every local worker, and the method used ('' if none)."""
    workers = local_workers(run_dir)
    if not workers:
        return {}, ""
    out: dict[int, str] = {}
    spy = _py_spy()
    if spy:
        procs = {rank: subprocess.Popen([spy, "dump", "--pid", str(pid)],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for rank, (pid, _local) in workers.items()}
        deadline = time.monotonic() + timeout_s
        for rank, proc in procs.items():
            try:
                text, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                continue
            if proc.returncode == 0 and text.strip():
                out[rank] = "py-spy dump:\n" + text.decode(errors="replace")[-_MAX_STACK_CHARS:]
    missing = {r: w for r, w in workers.items() if r not in out}
    if missing:
        out.update(_faulthandler_dumps(run_dir, attempt, missing))
    method = "py-spy" if spy and len(out) > len(missing) else "faulthandler"
    return out, method


def suspects(stacks: dict[int, str]) -> list[int]:
    """Ranks whose stacks are not waiting on a peer (no collective / p2p frame)."""
    return sorted(r for r, text in stacks.items() if not any(w in text for w in _WAITING))
