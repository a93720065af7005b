"""ds3dd running the real trainer (`ds3d.trainer.worker`, DeepSpeed on CPU/gloo) end to end:
start, train to the last step, COMPLETED, with step metrics and a checkpoint in the index.

Heavy: run serialised, `flock /tmp/ds3d-heavy.lock .venv/bin/pytest -m slow ...`."""

from __future__ import annotations

import json

import pytest
from test_daemon_support import DaemonProc, kill_job_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProc(tmp_path / "state", args=["--hang-timeout", "300"])
    d.start()
    yield d
    d.stop()
    kill_job_processes(d.state_dir)


def test_real_worker_runs_to_completion(daemon):
    r = daemon.ctl("start", "tiny", "--name", "real", "--steps", "6")
    assert r.returncode == 0, r.stderr
    job = daemon.wait_state("real", "COMPLETED", "FAILED", timeout_s=500)
    assert job["state"] == "COMPLETED", daemon.ctl("logs", "real", "--lines", "40").stdout
    assert job["step"] == 6 and job["loss"] is not None and job["tokens_per_s"] > 0
    cks = json.loads(daemon.ctl("checkpoints", "real", "--json").stdout)
    assert cks and cks[-1]["step"] == 6 and cks[-1]["present"]
    # where the step time went: the split of the sampled step 2 (train.timing_interval) in
    # `ds3dctl status`, as a table and in --json
    split = job["step_split"]
    assert split is not None and [s["stage"] for s in split["stages"]] == [0], split
    st = split["stages"][0]
    assert st["step"] >= 2 and st["forward_s"] > 0 and st["backward_s"] > 0, st
    assert st["compute_s"] <= st["step_s"] and split["bubble"] is None  # one stage
    text = daemon.ctl("status", "real").stdout
    assert "step-time split, seconds, sampled step" in text and "pipeline bubble: none" in text
