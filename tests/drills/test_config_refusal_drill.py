"""Drill (issue 17 item 8): a configuration the workers refuse is not a crash. A real ds3dd runs
the real worker on a data file that passes the daemon's start checks (it exists) but holds fewer
tokens than one sample; the worker refuses it with EXIT_CONFIG. With `launch.max_restarts=1`
the group must be launched once (no agent restart, no daemon relaunch), the job FAILED at once
with the refusal read from torch elastic's error file (the worker's `@record`), and 0 restarts.

Heavy: `flock /tmp/ds3d-heavy.lock .venv/bin/pytest -q tests/drills/test_config_refusal_drill.py`
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from ds3d.trainer.config import build_job_config  # noqa: E402

from test_daemon_support import DaemonProc, pb  # noqa: E402

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(400)
def test_refused_configuration_fails_after_one_launch(tmp_path):
    data = tmp_path / "short.bin"
    data.write_bytes(bytes(10))  # 5 uint16 tokens: fewer than one sample
    with DaemonProc(tmp_path / "state") as d:
        cfg = build_job_config("tiny", ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
                                        f"data.source={data}", "launch.max_restarts=1"],
                               name="refused")
        channel, stub = d.stub()
        with channel:
            stub.StartJob(pb.StartJobRequest(config_json=cfg.dump_json()), timeout=60)
        job = d.wait_state("refused", "FAILED", "COMPLETED", "RUNNING", timeout_s=300)
        assert job["state"] == "FAILED", job
        msg = job["message"]
        # the worker's error file, not a scraped stderr line: "Type: text"
        assert "ConfigError: " in msg and "fewer than one sample" in msg, msg
        assert "restarting would not help" in msg, msg
        assert job["restarts"] == 0, job
        evs = d.event_details("refused")
        assert [e["cause"] for e in evs if e["kind"] == "fault"] == ["config_refused"], evs
        assert len([e for e in evs if e["kind"] == "launch"]) == 1, evs
        # torch elastic started the group once: one attempt_N folder under the agent's logs
        run_dir = Path(job["run_dir"])
        groups = sorted(p.name for p in run_dir.glob("logs/attempt-*/*/attempt_*"))
        assert groups == ["attempt_0"], groups
