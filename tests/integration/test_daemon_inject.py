"""Daemon side of fault injection and of the multi-node address policy, through the real
`ds3dd`/`ds3dctl`, the real elastic agent and the contract-following stand-in worker:
* without --enable-fault-injection, InjectFault is FAILED_PRECONDITION saying how to enable it;
* with it, `ds3dctl inject` writes RUN_DIR/control/inject.json atomically with an increasing id,
  refuses bad ranks/kinds/states in one line, and records an `inject` event;
* a multi-node job naming a non-loopback node is refused unless the daemon has mutual TLS.

Slow (agents import torch); run serialised: flock /tmp/ds3d-heavy.lock .venv/bin/pytest ..."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from test_daemon_support import DaemonProc, kill_job_processes, pb, tiny_job_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def one_line(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_inject_refused_without_flag(tmp_path):
    d = DaemonProc(tmp_path / "state").start()
    try:
        msg = one_line(d.ctl("inject", "anyjob", "crash", "--rank", "0"))
        assert "FAILED_PRECONDITION" in msg and "--enable-fault-injection" in msg
        channel, stub = d.stub()
        with pytest.raises(grpc.RpcError) as e:
            stub.InjectFault(pb.InjectFaultRequest(name="anyjob", kind="nan", rank=0), timeout=10)
        channel.close()
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--enable-fault-injection" in e.value.details()
        # the CLI refuses an unknown kind before sending anything
        assert "invalid choice" in one_line(d.ctl("inject", "anyjob", "boom", "--rank", "0"))
    finally:
        d.stop()


def test_inject_writes_control_file(tmp_path):
    d = DaemonProc(tmp_path / "state", worker_dir=tmp_path / "worker",
                   extra_env={"FAKE_STEP_S": "0.25"},
                   args=["--enable-fault-injection", "--hang-timeout", "60"]).start()
    try:
        assert d.ctl("start", "tiny", "--name", "fi", "--dp", "2",
                     "--steps", "100000").returncode == 0
        # not yet running: nothing to inject into is refused by the state table, or accepted
        # while STARTING; either way a missing job is NOT_FOUND
        assert "NOT_FOUND" in one_line(d.ctl("inject", "nojob", "nan", "--rank", "0"))
        job = d.wait_for("fi", lambda j: j["state"] == "RUNNING" and j["step"] >= 2, "step 2")
        inject_file = Path(job["run_dir"]) / "control" / "inject.json"

        r = d.ctl("inject", "fi", "crash", "--rank", "1", "--at-step", "500")
        assert r.returncode == 0, r.stderr
        assert "crash on rank 1 at step 500" in r.stdout
        first = json.loads(inject_file.read_text())
        assert {k: first[k] for k in ("id", "kind", "rank", "at_step")} == \
            {"id": 1, "kind": "crash", "rank": 1, "at_step": 500}

        step_now = d.job("fi")["step"]
        r = d.ctl("inject", "fi", "slow", "--rank", "0")  # no --at-step: the next step
        assert r.returncode == 0, r.stderr
        second = json.loads(inject_file.read_text())
        assert second["id"] == 2 and second["kind"] == "slow" and second["rank"] == 0
        assert step_now + 1 <= second["at_step"] <= d.job("fi")["step"] + 1
        assert not list(inject_file.parent.glob(".*.tmp*"))  # tmp + rename left nothing behind

        assert "rank=2" in one_line(d.ctl("inject", "fi", "hang", "--rank", "2"))
        # ds3dctl refuses a negative step before sending; ds3dd refuses it from any client
        assert "--at-step: '-3'" in one_line(d.ctl("inject", "fi", "nan", "--rank", "0",
                                                   "--at-step", "-3"))
        channel, stub = d.stub()
        with pytest.raises(grpc.RpcError) as e:
            stub.InjectFault(pb.InjectFaultRequest(name="fi", kind="nan", rank=0, at_step=-3),
                             timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at_step=-3" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.InjectFault(pb.InjectFaultRequest(name="fi", kind="melt", rank=0), timeout=10)
        channel.close()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "melt" in e.value.details()
        assert json.loads(inject_file.read_text())["id"] == 2  # refusals wrote nothing

        injected = [e for e in d.events("fi") if e["kind"] == "inject"]
        assert [(e["cause"], e["rank"]) for e in injected] == [("crash", 1), ("slow", 0)]

        assert d.ctl("stop", "fi", "--now").returncode == 0
        d.wait_state("fi", "STOPPED")
        msg = one_line(d.ctl("inject", "fi", "nan", "--rank", "0"))
        assert "FAILED_PRECONDITION" in msg and "STOPPED" in msg
    finally:
        d.stop()
        kill_job_processes(d.state_dir)


def test_non_loopback_node_needs_tls(tmp_path):
    d = DaemonProc(tmp_path / "state").start()
    try:
        msg = one_line(d.ctl("start", "tiny", "--dp", "2", "--store", f"file://{tmp_path}/s",
                             "--hosts", f"{d.addr},10.9.8.7:7531"))
        assert "INVALID_ARGUMENT" in msg and "mutual TLS" in msg and "10.9.8.7:7531" in msg
        # multi-node without a shared durable tier is refused too
        channel, stub = d.stub()
        with pytest.raises(grpc.RpcError) as e:
            stub.StartJob(pb.StartJobRequest(config_json=tiny_job_json(
                parallel={"dp": 2}, launch={"nnodes": 2, "device": "cpu",
                                            "hosts": [d.addr, "127.0.0.1:9"]})), timeout=10)
        channel.close()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "checkpoint.store" in e.value.details()
        assert d.ctl("list", "--all").stdout.strip() == "no jobs"
    finally:
        d.stop()
