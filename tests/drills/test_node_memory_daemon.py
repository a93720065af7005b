"""Node memory under the daemon (checkpoints/node_memory.py): the real `ds3dd` with
--enable-fault-injection, the real trainer (TP 2 x PP 2, gloo on CPU) under the elastic agent,
the arenas in this test process's tmpfs folder (tests/conftest.py sets DS3D_NODE_MEMORY_ROOT,
which ds3dd and its workers inherit).

1. A crashed worker: the agent's restart restores the newest save from node memory; the
   `recovered` event says so; the job completes and nothing of it is left in node memory.
2. `stop --now` kills the workers (no clean exit, so their arenas stay): ds3dd removes the
   job's folder once the job is STOPPED.
3. A folder of a job that ended while ds3dd was down is removed at ds3dd's start; a folder of a
   job it does not know (another daemon's, a plain torchrun run) is left alone.

Heavy: `flock /tmp/ds3d-heavy.lock .venv/bin/pytest tests/drills/test_node_memory_daemon.py`."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from test_daemon_drills import inject_before_training, injected_step, logs  # noqa: E402

from ds3d.checkpoints.identity import local_job_id, new_job_id  # noqa: E402
from ds3d.checkpoints.node_memory import job_folder  # noqa: E402

from fixtures.s3 import free_port  # noqa: E402
from test_daemon_support import DaemonProc, kill_job_processes  # noqa: E402

pytestmark = [pytest.mark.slow]

LAYOUT = ["--tp", "2", "--pp", "2", "--dp", "1"]
SETS = ["--set", "checkpoint.interval=2", "--set", "train.warmup_steps=2"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    sock_dir = Path(tempfile.mkdtemp(prefix="ds3d-", dir="/tmp"))  # unix paths: < 108 bytes
    d = DaemonProc(tmp_path_factory.mktemp("nodemem") / "state",
                   listen=f"unix:{sock_dir}/ds3dd.sock",
                   args=["--enable-fault-injection", "--metrics-port", str(free_port())])
    d.start()
    yield d
    d.stop()
    kill_job_processes(d.state_dir)
    shutil.rmtree(sock_dir, ignore_errors=True)


def root() -> Path:
    return Path(os.environ["DS3D_NODE_MEMORY_ROOT"])


def wait_until(pred, what: str, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.timeout(900)
def test_a_crash_under_ds3dd_restarts_from_node_memory(daemon: DaemonProc) -> None:
    name = "crash"
    r = daemon.ctl("start", "tiny", "--name", name, *LAYOUT, "--steps", "12", *SETS)
    assert r.returncode == 0, r.stderr
    inject_before_training(daemon, name, "crash", rank=2)
    job = daemon.wait_state(name, "COMPLETED", "FAILED", timeout_s=600)
    assert job["state"] == "COMPLETED", logs(daemon, name)
    run_dir = Path(job["run_dir"])
    at = injected_step(run_dir)  # rank 2 exited before training step `at`
    held = (at - 1) // 2 * 2     # the newest save before it (every 2 steps)
    recovered = [e for e in daemon.event_details(name) if e["kind"] == "recovered"]
    assert len(recovered) == 1, recovered
    detail = recovered[0]["detail"]
    assert (detail["cause"], detail["resumed_from"], detail["source"]) == \
        ("worker_exit", held, "node_memory"), detail
    assert "(read from node_memory)" in recovered[0]["message"]
    restoring = [e for e in daemon.event_details(name)
                 if e["kind"] == "checkpoint" and e["detail"].get("phase") == "restoring"]
    assert [(e["step"], e["detail"]["source"]) for e in restoring] == [(held, "node_memory")]
    assert "from node memory" in restoring[0]["message"]
    job_id = local_job_id(run_dir)
    assert job_id and not job_folder(job_id, root()).exists()


@pytest.mark.timeout(600)
def test_stop_now_and_a_daemon_restart_remove_what_the_workers_left(daemon: DaemonProc) -> None:
    name = "stopped"
    r = daemon.ctl("start", "tiny", "--name", name, *LAYOUT, "--steps", "100000", *SETS)
    assert r.returncode == 0, r.stderr
    job = daemon.wait_for(name, lambda j: j["state"] == "RUNNING" and j["step"] >= 4,
                          "step 4", timeout_s=300)
    job_id = local_job_id(Path(job["run_dir"]))
    assert job_id
    folder = job_folder(job_id, root())
    wait_until(lambda: len(list(folder.glob("rank-*.held"))) == 4, "every rank's marker")
    assert daemon.ctl("stop", name, "--now").returncode == 0
    daemon.wait_state(name, "STOPPED", timeout_s=120)
    wait_until(lambda: not folder.exists(), f"ds3dd removing {folder}", timeout_s=30)

    # the job ended while ds3dd was down: its folder goes at the next start; a folder of a
    # job this daemon does not know stays
    daemon.stop()
    folder.mkdir(mode=0o700)
    (folder / "rank-00000.arena").write_bytes(b"\0" * 4096)
    foreign = job_folder(new_job_id(), root())
    foreign.mkdir(mode=0o700)
    try:
        daemon.start()
        wait_until(lambda: not folder.exists(), f"ds3dd removing {folder} at its start",
                   timeout_s=30)
        assert foreign.exists()
    finally:
        shutil.rmtree(foreign, ignore_errors=True)
