"""A process is known again by pid and start time, and a move of the boot time does not make
the daemon's own agent a stranger (it was then never stopped, and two worker groups ran)."""

from __future__ import annotations

import subprocess
import sys

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
