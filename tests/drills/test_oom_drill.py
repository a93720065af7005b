"""Out-of-memory drill: a real OOM, provoked by a process memory limit on CPU, through the real
`ds3dd` and `ds3dctl` and the real trainer (DeepSpeed on CPU/gloo, PP 2).

ds3dd runs under an address-space limit (RLIMIT_AS, inherited by the agent and the workers)
that lets torch + DeepSpeed start (a tiny PP-2 worker peaks at ~3.8 GiB of virtual memory) but
not hold the last stage's logits of a deliberately huge micro-batch: 8 x 1024 tokens x a 32768
vocabulary = 1 GiB per fp32 logits tensor. Only stage 1 (the output head) runs out; stage 0's
activations are 8 x 1024 x 64 floats. The job must end FAILED after one restart, with the
diagnosis (rank, the numbers, the fix) as its event and its reason.

Heavy: run serialised, `flock /tmp/ds3d-heavy.lock .venv/bin/pytest tests/drills/test_oom_drill.py`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from test_daemon_support import DaemonProc, kill_job_processes, pb  # noqa: E402

pytestmark = [pytest.mark.slow]

LIMIT = 5632 * 2**20  # 5.5 GiB of address space per process
HUGE = ["--set", "model.seq_len=1024", "--set", "model.vocab_size=32768",
        "--set", "train.micro_batch_size=8", "--set", "train.global_batch_size=8"]


def events(d: DaemonProc, name: str) -> list[dict]:
    """Events with their detail (ds3dctl events --json leaves the detail out)."""
    channel, stub = d.stub()
    try:
        return [{"kind": e.kind, "cause": e.cause, "rank": e.rank, "step": e.step,
                 "message": e.message, "detail": json.loads(e.detail_json or "{}")}
                for e in stub.WatchEvents(pb.WatchEventsRequest(name=name, follow=False),
                                          timeout=30)]
    finally:
        channel.close()


@pytest.fixture
def limited_daemon(tmp_path):
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) is needed to start ds3dd under RLIMIT_AS")
    d = DaemonProc(tmp_path / "state")
    d.argv = ["prlimit", f"--as={LIMIT}", "--", *d.argv]
    d.start()
    yield d
    d.stop()
    kill_job_processes(d.state_dir)


@pytest.mark.timeout(240)
def test_oom_is_diagnosed_restarted_once_then_fails(limited_daemon):
    d, name = limited_daemon, "oom"
    r = d.ctl("start", "tiny", "--name", name, "--tp", "1", "--pp", "2", "--dp", "1",
              "--steps", "3", *HUGE)
    assert r.returncode == 0, r.stderr
    job = d.wait_state(name, "COMPLETED", "FAILED", timeout_s=200)
    logs = d.ctl("logs", name, "--lines", "20").stdout[-3000:]
    assert job["state"] == "FAILED", logs

    evs = events(d, name)
    # the worker's own evidence: a `fault` record with cause oom, from rank 1 only
    raw = [e for e in evs if e["kind"] == "fault" and e["cause"] == "oom"]
    assert {e["rank"] for e in raw} == {1}, [e["message"] for e in raw]
    ev = raw[0]["detail"]
    assert ev["stage"] == 1 and ev["step"] == 1 and ev["phase"] == "step"
    assert ev["requested_bytes"] == 2**30  # one fp32 logits tensor: 8 x 1024 x 32768 x 4
    assert ev["limit_kind"] == "RLIMIT_AS" and ev["limit_bytes"] == LIMIT
    assert 0 < ev["peak_bytes"] < LIMIT and ev["peak_virtual_bytes"] <= LIMIT

    # the daemon's diagnosis: once with a restart, then fatal at the same step
    ooms = [e for e in evs if e["kind"] == "oom"]
    assert [e["cause"] for e in ooms] == ["oom", "oom"], [e["message"] for e in evs]
    first, second = ooms
    assert first["rank"] == 1 and first["step"] == 1
    msg = first["message"]
    assert msg.startswith("rank 1 (stage 1) ran out of memory at step 1 ("), msg
    for part in ("tried to allocate 1.0 GiB", "of a 5.5 GiB RLIMIT_AS limit",
                 "micro-batch 8 x 1024 tokens", "activation checkpointing off",
                 "lower train.micro_batch_size (now 8)",
                 "set parallel.activation_checkpoint_interval = 1",
                 "add pipeline stages (parallel.pp, now 2)",
                 "raise the RLIMIT_AS limit (5.5 GiB)",
                 "restarting once from the newest checkpoint"):
        assert part in msg, (part, msg)
    assert "it also ran out of memory at step 1 before the last restart" in second["message"]

    # counted under its own cause; the failure reason is the diagnosis
    transitions = [e for e in evs if e["kind"] == "state"]
    assert any(e["cause"] == "oom" and "restart 1 of" in e["message"] for e in transitions), \
        [e["message"] for e in transitions]
    assert job["restarts"] == 1
    assert job["message"] == second["message"]
    assert job["message"].startswith("rank 1 (stage 1) ran out of memory at step 1")
    # as a person reads them
    text = d.ctl("events", name, "--kind", "oom").stdout
    lines = text.splitlines()
    assert len(lines) == 2 and all(" oom " in ln and "rank 1 (stage 1) ran out of memory" in ln
                                   for ln in lines), text
    table = d.ctl("status", name).stdout
    assert "FAILED" in table and "rank 1 (stage 1) ran out of memory" in table, table
