"""ds3dd running the real trainer (`ds3d.trainer.worker`, DeepSpeed on CPU/gloo) end to end:
start, train to the last step, COMPLETED, with step metrics and a checkpoint in the index.

Heavy: run serialised, `flock /tmp/ds3d-heavy.lock .venv/bin/pytest -m slow ...`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds3d.trainer.config import build_job_config

from support import records
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
    # the status shows rank 0's newest step record, whose throughput is the step's tokens over
    # its measured time
    last = records(Path(job["run_dir"]), 0, "step")[-1]
    assert job["step"] == last["step"] == 6
    assert (job["loss"], job["tokens_per_s"]) == pytest.approx((last["loss"], last["tokens_per_s"]))
    cfg = build_job_config("tiny")
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    assert last["tokens_per_s"] == pytest.approx(tokens / last["step_time_s"], rel=1e-3)
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
