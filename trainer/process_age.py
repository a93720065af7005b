"""How long a process has been running, to 10 ms.

psutil's create_time is boot time + start ticks, and Linux gives the boot time in whole seconds,
so ages (and start times) from it are off by up to a second: too coarse for the hang detector's
start-up allowance and for timing a recovery. /proc gives both the process's start and the
uptime in ticks since boot, so their difference is exact to a tick."""

from __future__ import annotations

import os
import time
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_age_s(pid: int) -> float | None:
    """Seconds since process `pid` started (None if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22: starttime
        return max(0.0, uptime - start_ticks / _CLOCK_TICKS)
    except (OSError, ValueError, IndexError):
        pass
    import psutil  # not Linux

    try:
        return max(0.0, time.time() - psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def process_started_at(pid: int | None = None) -> float | None:
    """Unix time at which process `pid` (default: this one) started."""
    age = process_age_s(os.getpid() if pid is None else pid)
    return None if age is None else time.time() - age


class StartupTimeline:
    """Seconds from this process's start to each stage of a worker's start-up (config read,
    device chosen, process group, layout), carried in its `init` heartbeat: a restore's first
    seconds are otherwise one number, and the bench must tell the fork's wait for the agent
    from CUDA's and the process group's initialisation."""

    def __init__(self) -> None:
        self.started = process_started_at() or time.time()
        self.seconds: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        self.seconds[stage] = round(time.time() - self.started, 3)
