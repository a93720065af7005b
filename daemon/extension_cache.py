"""DeepSpeed's JIT-built ops per job, and their build locks.

Why this exists: every worker's first `deepspeed.init_distributed` JIT-builds the
`deepspeed_shm_comm` op (torch.utils.cpp_extension) under a `FileBaton`: the file `lock` in the
op's build folder, created with O_CREAT|O_EXCL, its descriptor kept open while ninja runs, removed
on release. A worker killed while holding it leaves the file, and every later build in that
folder waits on it forever (`FileBaton.wait` polls without a timeout). The file holds no pid.

What ds3d does about it:

* each job (each node's share of a job) builds in a folder of its own, `RUN_DIR/torch_extensions`
  (TORCH_EXTENSIONS_DIR for its workers), seeded with the ops already built in the warm cache
  (the daemon's TORCH_EXTENSIONS_DIR, else torch's `~/.cache/torch_extensions/py3X_cpu|cuXY`),
  copied with their file times so that ninja finds them up to date: a start killed in one job
  cannot block another. A warm folder that holds a lock is not copied (its state is unknown);
  the job then builds the op itself.
* before each start of a worker group the agent clears the locks of the job's folder that no
  live process holds. Liveness without a pid: the holder keeps the lock open until it releases
  it, and ninja and the compiler run with the build folder as their working directory; a lock
  that no process has open and in whose folder no process works is stale for sure. Compilers
  orphaned by a killed worker (they work there, but hold nothing) are ended first: at that point
  no worker of the group is alive, so they build for nobody. The folder of a stale lock is
  removed whole (an interrupted link may have left a truncated library newer than its inputs)
  and seeded again.
* the start-up detector (detectors.py) names every lock it finds, stale or held and how long,
  in its fault.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

LOCK_NAME = "lock"


def job_extensions_dir(run_dir: Path) -> Path:
    """The job's own TORCH_EXTENSIONS_DIR on this node."""
    return run_dir / "torch_extensions"


def warm_root(configured: str | None) -> Path:
    """The shared cache the job's folder is seeded from: `configured` (the daemon's
    TORCH_EXTENSIONS_DIR) or torch's default folder for this Python and torch build (the same
    path `torch.utils.cpp_extension._get_build_directory` uses; imports torch)."""
    if configured:
        return Path(configured)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    cu = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{cu}"


def cache_roots(configured: str | None) -> list[Path]:
    """Where the warm cache may be, without importing torch (the daemon's view, for naming
    locks): `configured`, else every `py*_*` folder of torch's default root."""
    if configured:
        return [Path(configured)]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return sorted(p for p in base.glob("py*_*") if p.is_dir())


@dataclass(frozen=True)
class BuildLock:
    """A `lock` file in an op's build folder, and who keeps it alive."""

    path: Path
    age_s: float
    holders: tuple[int, ...]  # pids with the lock open: the build in progress
    workers: tuple[int, ...]  # pids working in the build folder (ninja, the compiler)

    @property
    def stale(self) -> bool:
        return not self.holders and not self.workers

    def describe(self) -> str:
        if self.stale:
            return (f"stale build lock {self.path} ({self.age_s:.0f} s old, no live process holds "
                    f"it: a process was killed while building the op)")
        who = ", ".join(map(str, self.holders or self.workers))
        return f"build lock {self.path} held for {self.age_s:.0f} s by pid {who}"


def find_locks(roots: list[Path]) -> list[BuildLock]:
    """Every op build lock under `roots` (one level: ROOT/<op>/lock), with its holders."""
    paths = [p for root in roots if root.is_dir() for p in sorted(root.glob(f"*/{LOCK_NAME}"))]
    if not paths:
        return []
    opened: dict[Path, list[int]] = {p: [] for p in paths}
    inside: dict[Path, list[int]] = {p: [] for p in paths}
    folders = {p.parent.resolve(): p for p in paths}
    targets = {str(p.resolve()): p for p in paths}
    for proc in psutil.process_iter(["pid"]):
        pid = proc.info["pid"]
        if pid == os.getpid():
            continue
        try:
            cwd = Path(proc.cwd()).resolve()
            for folder, lock in folders.items():
                if cwd == folder or folder in cwd.parents:
                    inside[lock].append(pid)
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                held = targets.get(os.readlink(fd))
                if held is not None:
                    opened[held].append(pid)
        except (psutil.Error, OSError):
            continue  # gone, or another user's: its fds cannot be read
    now = time.time()
    out = []
    for p in paths:
        try:
            age = max(0.0, now - p.stat().st_mtime)
        except OSError:
            continue  # released meanwhile
        out.append(BuildLock(p, age, tuple(opened[p]), tuple(inside[p])))
    return out


def clear_stale_locks(root: Path) -> list[BuildLock]:
    """Removes the build folders under `root` whose lock no live process holds, after ending
    the orphaned compilers still working in them. Only for a folder no live worker of its job
    uses (the agent calls it before starting a group). Returns the locks it cleared."""
    cleared = []
    for lock in find_locks([root]):
        if lock.holders:
            continue  # a live process builds: not ours to break
        for pid in lock.workers:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        psutil.wait_procs([p for p in map(_proc, lock.workers) if p is not None], timeout=5)
        shutil.rmtree(lock.path.parent, ignore_errors=True)
        cleared.append(lock)
    return cleared


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def seed(job_root: Path, warm: Path) -> list[str]:
    """Copies the ops built in `warm` that `job_root` lacks (with their file times, so that ninja
    finds them up to date). Folders holding a lock are skipped. Returns the ops copied."""
    copied: list[str] = []
    if not warm.is_dir() or warm.resolve() == job_root.resolve():
        return copied
    job_root.mkdir(parents=True, exist_ok=True)
    for src in sorted(p for p in warm.iterdir() if p.is_dir()):
        dst = job_root / src.name
        if (src / LOCK_NAME).exists() or not any(src.glob("*.so")) or any(dst.glob("*.so")):
            continue
        tmp = job_root / f".{src.name}.seeding-{os.getpid()}"
        try:
            shutil.copytree(src, tmp, copy_function=shutil.copy2,
                            ignore=shutil.ignore_patterns(LOCK_NAME))
            shutil.rmtree(dst, ignore_errors=True)
            os.replace(tmp, dst)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            continue  # the op is then built in the job's folder
        copied.append(src.name)
    return copied


def prepare(job_root: Path, warm: Path) -> tuple[list[BuildLock], list[str]]:
    """Before a worker group starts: stale locks of the job's folder cleared, then the folder
    seeded from the warm cache. Returns (locks cleared, ops copied)."""
    job_root.mkdir(parents=True, exist_ok=True)
    cleared = clear_stale_locks(job_root)
    return cleared, seed(job_root, warm)


def wait_for_live_builds(root: Path, timeout_s: float, poll_s: float = 1.0) -> list[BuildLock]:
    """Waits until no live process holds a build lock under `root`; returns the locks still
    held after `timeout_s` (empty: none). Stale locks are not waited for (clear them first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = [lock for lock in find_locks([root]) if not lock.stale]
        if not held or time.monotonic() >= deadline:
            return held
        time.sleep(poll_s)


def warm_cache(configured: str | None, timeout_s: float) -> int:
    """Builds DeepSpeed's JIT op into the warm cache the jobs are seeded from (`make warm`, or
    an operator once per host: docs/runbook.md). A stale lock there (a process killed while it
    built or checked the op) would make the build wait forever, `FileBaton.wait` has no
    timeout: it is cleared first, and a lock a live process holds for longer than `timeout_s`
    is refused with its holder. Returns the exit status."""
    root = warm_root(configured)
    for lock in clear_stale_locks(root):
        print(f"extension cache: cleared the {lock.describe()}", flush=True)
    held = wait_for_live_builds(root, timeout_s)
    if held:
        print("extension cache: not warmed: " + "; ".join(lock.describe() for lock in held)
              + f" (still held after {timeout_s:.0f} s). End that process or wait for its build, "
              "then run this again.", file=sys.stderr, flush=True)
        return 1
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root))
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()
    return 0


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m ds3d.daemon.extension_cache",
        description="Build DeepSpeed's JIT op into the warm cache ds3dd seeds each job from "
                    "(TORCH_EXTENSIONS_DIR, else torch's default), clearing stale build locks.")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds to wait for a build another live process runs (default 900)")
    args = ap.parse_args(argv)
    sys.exit(warm_cache(os.environ.get("TORCH_EXTENSIONS_DIR") or None, args.timeout))


if __name__ == "__main__":
    main()
