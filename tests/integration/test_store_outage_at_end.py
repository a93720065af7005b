"""A store outage at the end of a job is waited out, not mistaken for a hang.

A real ds3dd with a short hang timeout (8 s) runs `tiny` at TP 2 into Ceph RGW. radosgw is
SIGKILLed while the job is training, past its newest committed checkpoint, and stays down for
longer than three hang timeouts, so the final checkpoint cannot be uploaded when the last
step is done. The workers wait for their final checkpoint to be durable, saying so every few
seconds (`store_wait` heartbeats): the daemon shows "waiting for the store", declares no hang and
restarts nothing, and the job becomes COMPLETED only once the gateway is back and the final
checkpoint is committed. Every step prefix left in the bucket is a committed checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from ds3d.checkpoints import layout

from test_daemon_support import DaemonProc

pytest_plugins = ["fixtures.s3", "fixtures.rgw"]
pytestmark = [pytest.mark.rgw, pytest.mark.slow, pytest.mark.timeout(400)]

HANG_TIMEOUT_S = 8.0
OUTAGE_S = 3.2 * HANG_TIMEOUT_S
STEPS, INTERVAL = 200, 50


def rank0_steps(run_dir: Path) -> int:
    path = run_dir / "reports" / "rank-00000.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(x).get("step", 0) for x in path.read_text().splitlines()
             if '"kind":"step"' in x]
    return max(steps, default=0)


def test_outage_at_the_end_completes_without_restart(
        rgw_cluster: Any, rgw_server: Any, rgw_bucket: str, tmp_path: Path) -> None:
    # the workers retry a failed upload every 2 s (default 30): the final commit follows the
    # gateway's return within seconds instead of waiting out a 30 s interval
    env = {**rgw_server.env(), "DS3D_S3_MAX_ATTEMPTS": "1", "DS3D_S3_OUTAGE_RETRIES": "1",
           "DS3D_UPLOAD_RETRY_S": "2"}
    with DaemonProc(tmp_path / "state", extra_env=env,
                    args=["--hang-timeout", str(HANG_TIMEOUT_S)]) as d:
        r = d.ctl("start", "tiny", "--name", "outage", "--tp", "2", "--steps", str(STEPS),
                  "--set", f"checkpoint.interval={INTERVAL}",
                  "--set", f'checkpoint.store="s3://{rgw_bucket}/jobs"')
        assert r.returncode == 0, r.stderr
        run_dir = tmp_path / "state" / "jobs" / "outage"
        deadline = time.monotonic() + 180
        while rank0_steps(run_dir) < INTERVAL + 15:  # the first checkpoint had time to commit
            assert time.monotonic() < deadline, d.job("outage")
            time.sleep(0.05)
        messages = []
        with rgw_cluster.gateway_down():
            # down for OUTAGE_S, and on a slow host until the workers have finished training
            # and the daemon says they wait for the store (not a race with the job's speed)
            t_down = time.monotonic()
            while time.monotonic() - t_down < OUTAGE_S or \
                    not any("waiting for the store" in m for _, m in messages):
                assert time.monotonic() - t_down < 240, messages[-5:]
                job = d.job("outage")
                messages.append((job["state"], job["message"]))
                assert job["state"] == "RUNNING", job
                time.sleep(1.0)
        done = d.wait_state("outage", "COMPLETED", "FAILED", timeout_s=120)
        assert done["state"] == "COMPLETED", done
        events = d.event_details("outage")

    # the workers finished training during the outage and then said they were waiting
    assert rank0_steps(run_dir) == STEPS
    waiting = [m for s, m in messages if "waiting for the store" in m]
    assert waiting, messages
    assert f"checkpoint step {STEPS} not durable yet" in waiting[-1], waiting[-1]
    # no hang, no restart, nothing trained twice
    assert not [e for e in events if e["kind"] == "fault"], [e["message"] for e in events
                                                             if e["kind"] == "fault"]
    assert done["restarts"] == 0
    starts = [e for e in events if e["kind"] in ("start", "recovery") and e["rank"] == 0]
    assert len(starts) == 1, starts
    # the final checkpoint is durable, and the bucket holds committed checkpoints only
    client = rgw_server.client()
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=rgw_bucket, Prefix="jobs/outage/") for o in page.get("Contents", [])]
    manifest = f"jobs/outage/{layout.manifest_key(STEPS)}"
    assert manifest in keys, keys
    steps_in_bucket = {k.split("/")[3] for k in keys if k.split("/")[2:3] == ["ckpt"]
                       and len(k.split("/")) > 4}
    for step_dir in steps_in_bucket:
        assert f"jobs/outage/ckpt/{step_dir}/MANIFEST.json" in keys, (step_dir, keys)
