"""The named semaphores an agent's process group leaves in /dev/shm, released once it is gone.

Torch elastic's MultiprocessContext, with the "forkserver" start method the agent uses, makes
an Event and a SimpleQueue per rank at every start of the worker group: named POSIX
semaphores, `/dev/shm/sem.mp-*` (multiprocessing's SemLock; with "fork" they would be unlinked
at once, with "forkserver" the workers open them by name). They are unlinked by their
finalizers when the agent exits cleanly, else by multiprocessing's resource tracker, a process
of the agent's group that outlives the others to do it. ds3dd's own SIGKILL spares the tracker
(procs.kill_group); a SIGKILL of the whole group from elsewhere (`kill -9 -PGID`, a node
agent, a test harness) takes it too, and the files stayed until reboot: several per group
start, without bound in a long run with restarts.

So the agent records the semaphores it holds after each group start (`record`: the sem files
its own /proc/self/maps names, by inode), and ds3dd, once the agent is gone and nothing of its
process group is left (the tracker included), unlinks those still there (`release`): each only
under the name and inode recorded, so a file created since under a reused name is never
touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .logging import get_logger
from .procs import group_members

SHM = Path("/dev/shm")
_PREFIX = "sem.mp-"  # multiprocessing's names: /mp-XXXXXXXX, a file sem.mp-XXXXXXXX in /dev/shm
RECORD_SUFFIX = ".sems"

log = get_logger("ds3d.semaphores")


def mapped_semaphores(pid: int | str = "self", shm: Path = SHM) -> dict[str, int]:
    """name -> inode of the multiprocessing semaphores in `shm` that process `pid` maps. glibc
    creates each under a temporary name and links it, so its mapping names the temporary
    (deleted) file: the inode is what identifies it."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            inodes = {int(line.split()[4]) for line in fh if f" {shm}/sem." in line}
    except (OSError, ValueError, IndexError):
        return {}
    if not inodes:
        return {}
    return {e.name: e.inode() for e in os.scandir(shm)
            if e.name.startswith(_PREFIX) and e.inode() in inodes}


def record(path: Path, shm: Path = SHM) -> None:
    """Adds the semaphores this process maps now to the record at `path` (those of earlier
    group starts stay in it: a context nobody released still holds its own), with this
    process's group, atomically."""
    held = _read(path).get("semaphores", {})
    held.update(mapped_semaphores("self", shm))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pgid": os.getpgid(0), "semaphores": held}))
    os.replace(tmp, path)


def release(run_dir: Path, shm: Path = SHM) -> list[str]:
    """Unlinks the recorded semaphores of every agent of `run_dir` whose process group is
    empty, then forgets the record; a group with a live process (its resource tracker, which
    unlinks them itself) is left for a later call. Returns the names it unlinked."""
    unlinked: list[str] = []
    for path in sorted((run_dir / "control").glob(f"*{RECORD_SUFFIX}")):
        rec = _read(path)
        pgid = rec.get("pgid")
        if not isinstance(pgid, int) or pgid <= 0 or group_members(pgid):
            continue
        for name, inode in dict(rec.get("semaphores", {})).items():
            if not (isinstance(name, str) and name.startswith(_PREFIX) and "/" not in name):
                continue
            target = shm / name
            try:
                if target.stat().st_ino == inode:
                    target.unlink()
                    unlinked.append(name)
            except FileNotFoundError:
                continue  # unlinked by its finalizer or the tracker
        path.unlink(missing_ok=True)
    if unlinked:
        log.info("named semaphores released", run_dir=str(run_dir), count=len(unlinked))
    return unlinked


def _read(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
