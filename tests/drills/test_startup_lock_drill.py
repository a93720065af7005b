"""Start-up lock drill (issue 17 item 7): a worker killed while it JIT-builds a C++ op must not
block any later start.

DeepSpeed builds its ops (`deepspeed_shm_comm` at every worker's first init) with
torch.utils.cpp_extension: a FileBaton `lock` in TORCH_EXTENSIONS_DIR/<op>/, ninja and the
compiler working in that folder. The first test drives that same path with a smaller real op
(one ATen source, `ds3d_drill_op`, built by a stand-in worker before it follows the worker
contract): DeepSpeed's two-source op took ~40 s per build on two cores and the drill needs two
builds and a half. The daemon's warm cache (TORCH_EXTENSIONS_DIR) is an empty folder, so the
first job's worker has to build the op under the lock. The drill waits until a live worker
holds that lock, SIGKILLs it mid-build (its compilers keep running as orphans, the lock stays),
and starts a second job at once. The second job must train within the configured start-up time
(its own extension folder: nothing of the first can block it), and the first job's restarted
group must train too (its agent ended the orphans and cleared the stale lock). A second test
checks, with a lock left by a really killed holder, that the start-up fault names the lock and
that only locks no live process holds are cleared.

Heavy: `flock /tmp/ds3d-heavy.lock .venv/bin/pytest -q tests/drills/test_startup_lock_drill.py`
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from ds3d.daemon.detectors import StartupDetector  # noqa: E402
from ds3d.daemon.extension_cache import clear_stale_locks, find_locks  # noqa: E402
from ds3d.daemon.procs import WorkerTitle  # noqa: E402
from ds3d.daemon.reports import Observation  # noqa: E402
from ds3d.daemon.states import JobState  # noqa: E402
from ds3d.trainer.config import build_job_config  # noqa: E402

from test_daemon_support import FAKE_WORKER, DaemonProc, pb  # noqa: E402

pytestmark = [pytest.mark.slow]

START_TIMEOUT_S = 300
OP = "deepspeed_shm_comm"
DRILL_OP = "ds3d_drill_op"

# A real op, smaller than DeepSpeed's: one source against ATen's headers (a few seconds of
# compiling, long enough to be caught mid-build), loaded as a torch library.
DRILL_OP_SOURCE = r'''
#include <ATen/ATen.h>
at::Tensor ds3d_drill_twice(const at::Tensor& x) { return x * 2; }
'''

# The stand-in worker: builds the op at start-up the way DeepSpeed's builder does (torch's JIT
# load into TORCH_EXTENSIONS_DIR, which ds3d's agent points at the job's own folder), then
# follows the worker contract (tests/integration/test_daemon_support.FAKE_WORKER).
BUILD_WORKER = r'''
import os
from torch.utils.cpp_extension import load
load(name=os.environ["DS3D_DRILL_OP"], sources=[os.environ["DS3D_DRILL_OP_SOURCE"]],
     is_python_module=False)
''' + FAKE_WORKER


def start_job(d: DaemonProc, name: str) -> None:
    cfg = build_job_config("tiny", ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
                                    "train.steps=4", "launch.max_restarts=2"], name=name)
    channel, stub = d.stub()
    with channel:
        stub.StartJob(pb.StartJobRequest(config_json=cfg.dump_json()), timeout=60)


def held_lock(ext_dir: Path, timeout_s: float) -> tuple[Path, int]:
    """The op's build lock under `ext_dir` and the live worker holding it, once there is one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for lock in find_locks([ext_dir]):
            for pid in lock.holders:
                try:
                    if WorkerTitle.parse(psutil.Process(pid).cmdline()) is not None:
                        return lock.path, pid
                except psutil.Error:
                    continue
        time.sleep(0.1)
    raise AssertionError(f"no worker held a build lock under {ext_dir} in {timeout_s} s")


@pytest.mark.timeout(900)
def test_worker_killed_during_the_op_build_blocks_no_later_start(tmp_path):
    cold = tmp_path / "empty-extension-cache"
    cold.mkdir()
    workers = tmp_path / "workers"
    workers.mkdir()
    (workers / "ds3d_build_worker.py").write_text(BUILD_WORKER)
    source = tmp_path / f"{DRILL_OP}.cpp"
    source.write_text(DRILL_OP_SOURCE)
    env = {"TORCH_EXTENSIONS_DIR": str(cold), "DS3D_DRILL_OP": DRILL_OP,
           "DS3D_DRILL_OP_SOURCE": str(source),
           "PYTHONPATH": f"{workers}:{os.environ.get('PYTHONPATH', '')}"}
    with DaemonProc(tmp_path / "state", extra_env=env,
                    args=["--start-timeout", str(START_TIMEOUT_S), "--hang-timeout", "300",
                          "--worker-module", "ds3d_build_worker"]) as d:
        start_job(d, "first")
        first_dir = Path(d.wait_for("first", lambda j: j["run_dir"], "a run dir")["run_dir"])
        lock, pid = held_lock(first_dir / "torch_extensions", timeout_s=240)
        assert lock == first_dir / "torch_extensions" / DRILL_OP / "lock"
        os.kill(pid, signal.SIGKILL)  # mid-build: the lock stays, its compilers run on
        killed_at = time.monotonic()

        start_job(d, "second")
        second = d.wait_state("second", "COMPLETED", "FAILED", timeout_s=START_TIMEOUT_S + 120)
        assert second["state"] == "COMPLETED", d.ctl("logs", "second").stdout[-4000:]
        second_dir = Path(second["run_dir"])
        assert (second_dir / "torch_extensions" / DRILL_OP / f"{DRILL_OP}.so").is_file()
        # it trained within the configured start-up time, and no start-up fault was needed
        started = [e for e in d.event_details("second") if e["kind"] == "start"]
        assert started, d.event_details("second")
        assert time.monotonic() - killed_at < START_TIMEOUT_S + 60
        assert not [e for e in d.event_details("second") if e["cause"] == "startup_timeout"]

        # the killed job itself: its agent cleared the stale lock before the restarted group
        first = d.wait_state("first", "COMPLETED", "FAILED", timeout_s=START_TIMEOUT_S + 120)
        assert first["state"] == "COMPLETED", d.ctl("logs", "first").stdout[-4000:]
        agent_log = (first_dir / "logs" / "agent.log").read_text()
        assert f"cleared stale build lock {lock}" in agent_log, agent_log[-3000:]
        assert not lock.exists()
        assert not list(cold.iterdir())  # nothing was built in (or taken from) the warm cache


HOLD_LOCK = r'''
import sys, time
from torch.utils.file_baton import FileBaton
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("held", flush=True)
time.sleep(3600)
'''


def _lock_held_by_a_live_process(tmp_path: Path) -> tuple[Path, Path, subprocess.Popen[bytes]]:
    """(extensions folder, its op's build lock, the live process holding it)."""
    ext = tmp_path / "torch_extensions"
    (ext / OP).mkdir(parents=True)
    lock = ext / OP / "lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock)],
                              stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
    return ext, lock, holder


@dataclass
class _Job:
    """The fields StartupDetector reads."""

    config_json: str
    run_dir: str
    state: JobState = JobState.STARTING
    desired_state: JobState = JobState.RUNNING
    agent_pid: int = 12345
    attempt: int = 1


@pytest.mark.timeout(120)
def test_startup_fault_names_a_lock_left_by_a_killed_holder(tmp_path):
    ext, lock, holder = _lock_held_by_a_live_process(tmp_path)
    try:
        [live] = find_locks([ext])
        assert live.holders == (holder.pid,) and not live.stale
        assert clear_stale_locks(ext) == [] and lock.exists()  # a live holder's lock stays
    finally:
        holder.kill()
        holder.wait()
    [dead] = find_locks([ext])
    assert dead.stale and dead.path == lock

    cfg = build_job_config("tiny", ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1"],
                           name="blocked")
    job = _Job(cfg.dump_json(), str(tmp_path))
    detector = StartupDetector(timeout_s=0.5, lock_roots=lambda j: [ext])
    assert detector.check(job, Observation(), None) is None  # the clock starts at the launch
    time.sleep(0.7)
    fault = detector.check(job, Observation(), None)
    assert fault is not None and fault.cause == "startup_timeout" and fault.restart
    assert f"stale build lock {lock}" in fault.message, fault.message
    assert "ranks [0] sent none" in fault.message, fault.message
    assert fault.detail["locks"][0]["path"] == str(lock) and fault.detail["locks"][0]["stale"]
    assert detector.check(job, Observation(), None) is None  # once per launch

    assert [c.path for c in clear_stale_locks(ext)] == [lock]
    assert not (ext / OP).exists()  # the interrupted build's folder goes with its lock


def _warm(ext: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`make warm`'s command against the warm cache `ext`."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, "-m", "ds3d.daemon.extension_cache",
                           "--timeout", str(timeout_s)],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(660)
def test_warming_the_cache_clears_a_killed_holders_lock_and_waits_on_no_live_one(tmp_path):
    """The CI of 12-06 hung 90 minutes in `make warm`: a lock left in the shared cache by a
    process killed during an earlier build, and torch's FileBaton waits on it forever."""
    ext, lock, holder = _lock_held_by_a_live_process(tmp_path)
    try:
        refused = _warm(ext, timeout_s=1)
        assert refused.returncode == 1, refused.stderr
        assert f"build lock {lock} held for" in refused.stderr
        assert f"by pid {holder.pid}" in refused.stderr and lock.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock.exists()  # the killed holder's lock stays: what hung CI

    warmed = _warm(ext, timeout_s=1)
    assert warmed.returncode == 0, warmed.stderr
    assert f"cleared the stale build lock {lock}" in warmed.stdout
    assert not lock.exists() and (ext / OP / f"{OP}.so").is_file()
