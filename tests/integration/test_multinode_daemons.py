"""Two daemons on loopback acting as two nodes run one job together: the real trainer, one
process per node (DP 2, gloo), launched by each daemon's own elastic agent. The head (A) gets the
job with the host list [A, B], asks B to start its share (StartShare), and hosts the c10d
rendezvous in its own store process; both agents join it. `ds3dctl status` answers for the whole
job on either daemon (B passes the request on to the head), and so do pause and resume: global
rank 0, which reads the commands, lands on either node, so the head copies command files to B.
Paused and resumed, the job's losses equal a one-node torchrun of the same layout.

Heavy: run serialised,
`flock /tmp/ds3d-heavy.lock .venv/bin/pytest tests/integration/test_multinode*`."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from pathlib import Path

import pytest

from ds3d.daemon import stacks
from ds3d.daemon.procs import job_workers

from support import losses, records, torchrun
from test_daemon_support import (
    DaemonProc,
    frozen_workers,
    kill_job_processes,
    loopback_nodes,
    new_token,
    pb,
    wait_for_commit,
    wait_reported_step,
    worker_procs,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def rank0_records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "reports" / "rank-00000.jsonl"
    return records(run_dir, 0, kind) if path.exists() else []


@pytest.fixture
def nodes(tmp_path):
    # both accept injections: ShareControl refuses inject.json on a node without the flag
    with loopback_nodes(tmp_path, "--enable-fault-injection") as pair:
        yield pair


def _command_action(run_dir: Path) -> str:
    """The action of the job's control/command.json on one node ("" before the first)."""
    try:
        return str(json.loads((run_dir / "control" / "command.json").read_text())["action"])
    except FileNotFoundError:
        return ""


def test_two_daemons_run_one_job(nodes, tmp_path):
    a, b = nodes
    steps = 40  # the pause reaches the job at step 3 or 4 whatever its speed (frozen below)
    store = tmp_path / "shared-store"  # the durable tier both nodes write (s3:// in production)
    r = a.ctl("start", "tiny", "--name", "mn", "--dp", "2", "--steps", str(steps),
              "--hosts", f"{a.addr},{b.addr}", "--store", f"file://{store}")
    assert r.returncode == 0, r.stderr

    # both workers are frozen the moment rank 0 (on B) reports step 3, until the pause is in
    # both nodes' command.json: what the test asks of the job (status on both nodes, an
    # injection, the pause) reaches it before its next step, however far the daemons lag
    share_dir = b.state_dir / "shares" / "mn"
    wait_reported_step(share_dir, 3)
    with frozen_workers(a.state_dir / "jobs" / "mn", 1), frozen_workers(share_dir, 1):
        running = a.wait_for("mn", lambda j: j["step"] >= 3 or j["state"] in ("FAILED",
                                                                               "COMPLETED"),
                             "step 3", timeout_s=300)
        assert running["state"] == "RUNNING", a.ctl("logs", "mn").stdout[-5000:]
        seen_from_b = b.job("mn")  # forwarded to the head
        assert seen_from_b["node"] == "node-a" and seen_from_b["layout"]["nnodes"] == 2
        assert seen_from_b["world_size"] == 2 and seen_from_b["step"] >= 3
        assert "mn" in b.ctl("status").stdout

        # an injection (asked on B, passed on to the head) is copied to every node: the rank it
        # names may run on either (this one is scheduled after the last step: it never fires)
        r = b.ctl("inject", "mn", "slow", "--rank", "1", "--at-step", "1000000")
        assert r.returncode == 0, r.stderr
        share_inject = b.state_dir / "shares" / "mn" / "control" / "inject.json"
        head_inject = Path(running["run_dir"]) / "control" / "inject.json"
        assert json.loads(share_inject.read_text()) == json.loads(head_inject.read_text())
        assert json.loads(share_inject.read_text())["rank"] == 1

        r = b.ctl("pause", "mn")  # asked on the other node: passed on to the head
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 60  # the head's supervisor writes it, then forwards it
        while not _command_action(share_dir) == _command_action(Path(running["run_dir"])) \
                == "pause":
            assert time.monotonic() < deadline, "the pause did not reach both nodes"
            time.sleep(0.05)
    paused = b.wait_state("mn", "PAUSED", "FAILED", "COMPLETED", timeout_s=180)
    assert paused["state"] == "PAUSED", a.ctl("logs", "mn").stdout[-5000:]
    assert paused["last_checkpoint_step"] == paused["step"] < steps
    assert (store / "mn" / "ckpt" / f"step-{paused['step']:08d}" / "MANIFEST.json").is_file()
    head_dir, share_dir = Path(paused["run_dir"]), b.state_dir / "shares" / "mn"
    assert worker_procs(head_dir) == worker_procs(share_dir) == []
    assert b.ctl("resume", "mn").returncode == 0

    done = a.wait_state("mn", "COMPLETED", "FAILED", timeout_s=300)
    assert done["state"] == "COMPLETED", a.ctl("logs", "mn").stdout[-5000:]
    assert done["step"] == steps and done["world_size"] == 2 and math.isfinite(done["loss"])
    assert b.job("mn") == a.job("mn")

    # one agent per daemon, both on the head's rendezvous store process
    port = int((head_dir / "control" / "rdzv.port").read_text())
    for run_dir in (head_dir, share_dir):
        spec = json.loads((run_dir / "control" / "agent-1.json").read_text())
        assert spec["rdzv_endpoint"] == f"127.0.0.1:{port}" and spec["nproc_per_node"] == 1
        assert spec["run_id"] == "mn-a1"
        assert json.loads((run_dir / "control" / "agent-2.json").read_text())["run_id"] == "mn-a2"
        assert worker_procs(run_dir) == []
    assert not (head_dir / "reports" / "rank-00000.jsonl").exists()
    assert (share_dir / "reports" / "rank-00000.jsonl").exists()
    # each node ran one rank per attempt (which one is the rendezvous' choice)
    for d in (head_dir, share_dir):
        per_node = [r for f in (d / "reports").glob("rank-*.jsonl")
                    for r in records(d, int(f.stem.split("-")[1]), "start")]
        assert len(per_node) == 2, d
    starts = [r for d in (head_dir, share_dir) for r in rank0_records(d, "start")]
    assert len(starts) == 2 and {r["world_size"] for r in starts} == {2}
    assert sorted(r["step"] for r in starts) == [0, paused["step"]]
    got = {r["step"]: r["loss"] for r in sorted(
        (r for d in (head_dir, share_dir) for r in rank0_records(d, "step")),
        key=lambda r: r["time"])}
    assert sorted(got) == list(range(1, steps + 1))
    ref_dir = tmp_path / "ref"
    torchrun(ref_dir, 2, sets=["name=mn", "parallel.dp=2", f"train.steps={steps}"])
    want = losses(ref_dir)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), f"step {step}"
    # the head saw every rank's records: the share's were pulled into reports/nodes/
    assert list((head_dir / "reports" / "nodes").glob("*/rank-*.jsonl"))
    events = a.events("mn")
    assert {e["rank"] for e in events if e["kind"] == "start"} == {0, 1}
    assert [e["to"] for e in events if e["kind"] == "state"][-4:] == \
        ["PAUSED", "STARTING", "RUNNING", "COMPLETED"]
    assert any(e["kind"] == "share" for e in events)
    assert (store / "mn" / "ckpt" / f"step-{steps:08d}" / "MANIFEST.json").is_file()

    channel, stub = b.stub()
    try:
        # NodeStatus is a node-to-node call: asked as the head asks it, with the peer token
        status = stub.NodeStatus(pb.NodeStatusRequest(), timeout=10, metadata=[
            ("authorization", f"Bearer {b.peer_token}")])
    finally:
        channel.close()
    assert status.node == "node-b" and [s.job for s in status.shares] == ["mn"]
    assert status.shares[0].exit_code == 0


def test_a_rank_killed_on_another_node_is_named_by_the_head(nodes, tmp_path):
    """A worker SIGKILLed on node B (global rank 0 runs there): B's agent names it in its
    faults file and restarts the group, and the head, which pulls that file with B's reports,
    stores a worker_exit fault naming rank 0, SIGKILL and node-b. Before, the head read only
    its own agent's file: its rank 1 had merely lost its peer."""
    a, b = nodes
    r = a.ctl("start", "tiny", "--name", "blame", "--dp", "2", "--steps", "100000",
              "--hosts", f"{a.addr},{b.addr}", "--store", f"file://{tmp_path}/store",
              "--set", "checkpoint.interval=0")
    assert r.returncode == 0, r.stderr
    share_dir = b.state_dir / "shares" / "blame"
    wait_reported_step(share_dir, 3, timeout_s=300)
    [(pid, _local)] = [w for rank, w in stacks.local_workers(share_dir).items() if rank == 0]
    os.kill(pid, signal.SIGKILL)

    def named(j: dict) -> bool:
        return any(e["kind"] == "fault" and e["cause"] == "worker_exit" and
                   e["node"] == "node-b" for e in a.events("blame")) or \
            j["state"] in ("FAILED", "COMPLETED")

    a.wait_for("blame", named, "the head's fault event for node-b's rank", timeout_s=180)
    [fault] = [e for e in a.events("blame") if e["kind"] == "fault" and e["node"] == "node-b"]
    assert fault["rank"] == 0 and fault["cause"] == "worker_exit", fault
    assert " on node node-b: rank 0 failed first: killed by SIGKILL (signal 9)" in \
        fault["message"], fault
    assert a.ctl("stop", "blame", "--now").returncode == 0
    a.wait_state("blame", "STOPPED", "FAILED", timeout_s=120)


def test_unreachable_node_fails_the_launch_cleanly(tmp_path):
    """A node in the host list whose daemon is down: StartShare fails, the launch counts as a
    `node_lost` fault against the restart budget (0 here), and nothing is left running. Runs the
    stand-in worker (test_daemon_support.py), not the trainer: no worker gets to start."""
    a = DaemonProc(tmp_path / "a", node="node-a", worker_dir=tmp_path / "worker",
                   args=["--hang-timeout", "60"]).start()
    try:
        r = a.ctl("start", "tiny", "--name", "lonely", "--dp", "2", "--hosts",
                  f"{a.addr},127.0.0.1:1", "--store", f"file://{tmp_path}/store",
                  "--set", "launch.max_restarts=0")
        assert r.returncode == 0, r.stderr
        job = a.wait_state("lonely", "FAILED", "RUNNING", "COMPLETED", timeout_s=120)
        assert job["state"] == "FAILED"
        assert "node_lost" in job["message"] and "restart budget" in job["message"]
        faults = [e for e in a.events("lonely") if e["kind"] == "fault"]
        assert faults and faults[0]["cause"] == "node_lost"
        assert "127.0.0.1:1" in faults[0]["message"]
        assert worker_procs(Path(job["run_dir"])) == []
    finally:
        a.stop()
        kill_job_processes(a.state_dir)


def test_lost_node_job_finishes_on_the_others_with_a_reshape(tmp_path):
    """Three daemons as three nodes run an elastic job (DP 3, launch.min_nodes 2). One node
    is SIGKILLed, daemon, agent and worker together: the other two re-rendezvous, DP shrinks to
    2 with the same global batch, the newest checkpoint is reshaped (universal) to the new
    layout. Then the node's daemon restarts (same state dir and address): the head has the
    workers checkpoint and exit, and relaunches the job on all three nodes, DP back to 3 from
    that checkpoint reshaped again. The job completes; its losses equal a torchrun reference
    that goes through the same DP 3 -> 2 -> 3 steps by stopping and resuming (the data order
    does not depend on DP; over 100 steps a run at another DP drifts apart, fp32 sums taken
    in another order, so the reference takes the same path)."""
    token = new_token()
    daemons = [DaemonProc(tmp_path / n, token=token, node=f"node-{n}",
                          args=["--hang-timeout", "120", "--node-addr", f"127.0.0.{i + 1}",
                                "--enable-fault-injection"])
               for i, n in enumerate("abc")]
    steps = 100
    sets = ["--set", "launch.min_nodes=2", "--set", "train.micro_batch_size=1",
            "--set", "train.global_batch_size=6", "--set", "checkpoint.interval=10",
            "--set", "train.warmup_steps=2"]
    store = tmp_path / "shared-store"
    try:
        for d in daemons:
            d.start()
        a, _b, c = daemons
        r = a.ctl("start", "tiny", "--name", "ln", "--dp", "3", "--steps", str(steps), *sets,
                  "--hosts", ",".join(d.addr for d in daemons), "--store", f"file://{store}")
        assert r.returncode == 0, r.stderr
        # min_nodes 2: on a loaded machine node c's agent can miss the first rendezvous round
        # (CI of 12-06: the job was at DP 2 from its start), and torch elastic takes it in at a
        # re-rendezvous; the loss must strike a DP 3 group
        three = a.wait_for("ln", lambda j: j["world_size"] == 3 and j["state"] == "RUNNING"
                           or j["state"] in ("FAILED", "COMPLETED"), "DP 3", timeout_s=300)
        assert three["state"] == "RUNNING", a.ctl("logs", "ln").stdout[-5000:]
        # the kill lands just after a commit (nine steps before the next save), not while a
        # checkpoint is half uploaded: a pending commit that waits for the dead rank's part
        # holds up rank 0's later uploads for the commit timeout (600 s)
        wait_for_commit(a, store, "ln", (three["step"] // 10 + 1) * 10)

        c.kill()  # node c dies: its daemon, then its agent and worker, all by SIGKILL
        kill_job_processes(c.state_dir)
        job = a.job("ln")
        assert job["world_size"] == 3 and job["step"] < steps - 50, job

        short = a.wait_for("ln", lambda j: j["world_size"] == 2 and j["state"] == "RUNNING"
                           or j["state"] in ("FAILED", "COMPLETED"), "DP 2", timeout_s=300)
        assert short["state"] == "RUNNING", a.ctl("logs", "ln").stdout[-5000:]
        # the DP 2 group must outlast node c's return, however loaded the machine (CI of
        # 12-05 and 12-06 saw it train to the end first, at DP 2): its two workers are stopped
        # (SIGSTOP) until the head has noticed node c and queued the restart that takes it
        # back, then continued (the collectives' timeout is 300 s, the hang timeout 120 s)
        # (and rank 0 computes 0.1 s slower a micro-batch from its next step, so the few steps
        # between the continue and the command's delivery on the head's next tick stay few)
        r = a.ctl("inject", "ln", "slow", "--rank", "0")
        assert r.returncode == 0, r.stderr
        dp2 = list(job_workers(tmp_path, below=True))
        assert len(dp2) == 2, dp2
        for p in dp2:
            p.send_signal(signal.SIGSTOP)
        try:
            # node c returns: a new daemon on the same state dir and address
            c.argv[c.argv.index("--listen") + 1] = c.addr
            c.start()
            deadline = time.monotonic() + 90
            while not any(e["kind"] == "command" and "back: checkpoint" in e["message"]
                          for e in a.events("ln")):
                assert time.monotonic() < deadline, a.events("ln")
                time.sleep(0.5)
        finally:
            for p in dp2:
                p.send_signal(signal.SIGCONT)

        done = a.wait_state("ln", "COMPLETED", "FAILED", timeout_s=500)
        assert done["state"] == "COMPLETED", a.ctl("logs", "ln").stdout[-5000:]
        # (CI of 12-05 saw world_size 1 here once, not reproduced: the start records of every
        # node's rank 0 say which group reported it)
        assert done["step"] == steps and done["world_size"] == 3, (done, [
            (p.parent.name, r.get("world_size"), r.get("step"), r.get("time"))
            for p in Path(done["run_dir"]).glob("reports/**/rank-00000*.jsonl")
            for r in map(json.loads, p.read_text().splitlines()) if r.get("kind") == "start"])

        events = a.events("ln")
        lost = [e for e in events if e["kind"] == "fault" and e["cause"] == "node_lost"
                and "DP 3 -> 2" in e["message"]]
        assert len(lost) == 1, events
        joined = [e for e in events if e["cause"] == "node_joined"]
        assert len(joined) == 1 and "DP 2 -> 3" in joined[0]["message"], events
        back = [e for e in events if e["kind"] == "state" and e["cause"] == "node_back"]
        assert len(back) == 1 and "relaunching on all nodes" in back[0]["message"], events
        assert any(e["kind"] == "checkpoint" and "reshaped" in e["message"] for e in events)
        # what the recovery cost, as one event (the planned relaunch for node c is not a fault)
        recovered = [e for e in events if e["kind"] == "recovered"]
        assert [e["cause"] for e in recovered] == ["node_lost"], events
        assert re.search(r"noticed [\d.]+ s after the last step \(agent\), training again "
                         r"[\d.]+ s later from step \d+ \(read from (local|store)\); "
                         r"\d+ step\(s\) trained again",
                         recovered[0]["message"]), recovered[0]["message"]
        head_dir = Path(done["run_dir"])
        reshaped = [r["detail"] for r in rank0_records(head_dir, "checkpoint")
                    if r["phase"] == "reshaped"]
        assert reshaped == ["(tp,pp,dp) 1,1,3 -> 1,1,2", "(tp,pp,dp) 1,1,2 -> 1,1,3"], reshaped
        starts = rank0_records(head_dir, "start")
        worlds = [s["world_size"] for s in starts]
        assert [w for i, w in enumerate(worlds) if worlds[i - 1:i] != [w]] == [3, 2, 3], starts
        shrunk = next(s for s in starts if s["world_size"] == 2)
        assert shrunk["dp"] == 2 and shrunk["step"] >= 10
        # the workers checkpointed and exited on the head's `restart`: DP 3 resumed from that
        # very step, no step was re-done
        restart = [r for r in rank0_records(head_dir, "command") if r["action"] == "restart"]
        assert len(restart) == 1 and restart[0]["status"] == "done"
        assert starts[-1]["dp"] == 3 and starts[-1]["step"] == restart[0]["step"]

        got = losses(head_dir)
        assert sorted(got) == list(range(1, steps + 1))
        ref = tmp_path / "ref"
        ref_sets = ["name=ln", "parallel.dp=3", "launch.nnodes=3", "launch.min_nodes=2",
                    "train.micro_batch_size=1", "train.global_batch_size=6",
                    "train.warmup_steps=2", f"train.steps={steps}", "checkpoint.interval=0"]
        for nproc, until in ((3, shrunk["step"]), (2, restart[0]["step"]), (3, None)):
            torchrun(ref, nproc, sets=ref_sets,
                     extra=["--stop-at-step", str(until)] if until is not None else [])
        want = losses(ref)
        for step in range(1, steps + 1):
            assert got[step] == pytest.approx(want[step], rel=1e-5), f"step {step}"
    finally:
        for d in daemons:
            d.stop()
        for d in daemons:
            kill_job_processes(d.state_dir)


def test_a_lost_nodes_checkpoint_the_converter_refuses_pauses_the_job(tmp_path):
    """Two nodes at DP 2 (launch.min_nodes 1) whose checkpoints DeepSpeed's converter refuses
    (drill: `unconvertible` on rank 0: a pattern no parameter matches). Node b is SIGKILLed:
    node a alone must restore the newest checkpoint at DP 1, its conversion fails in two worker
    groups, and the job is PAUSED: not rolled back (an older checkpoint needs the same
    conversion), not FAILED by the restart budget, every checkpoint kept, the message naming
    the layout change, DeepSpeed's error and the ways out. Node b returns and `ds3dctl resume`
    runs the job at DP 2 again from that checkpoint, loaded as saved, to its end."""
    token = new_token()
    a, b = daemons = [DaemonProc(tmp_path / n, token=token, node=f"node-{n}",
                                 args=["--hang-timeout", "120", "--node-addr", f"127.0.0.{i + 1}",
                                       "--enable-fault-injection"])
                      for i, n in enumerate("ab")]
    steps = 400
    store = tmp_path / "shared-store"
    try:
        for d in daemons:
            d.start()
        r = a.ctl("start", "tiny", "--name", "uc", "--dp", "2", "--steps", str(steps),
                  "--set", "launch.min_nodes=1", "--set", "train.micro_batch_size=1",
                  "--set", "train.global_batch_size=2", "--set", "checkpoint.interval=5",
                  "--set", "train.warmup_steps=2", "--hosts", f"{a.addr},{b.addr}",
                  "--store", f"file://{store}")
        assert r.returncode == 0, r.stderr
        two = a.wait_for("uc", lambda j: j["world_size"] == 2 and j["state"] == "RUNNING"
                         or j["state"] in ("FAILED", "COMPLETED"), "DP 2", timeout_s=300)
        assert two["state"] == "RUNNING", a.ctl("logs", "uc").stdout[-5000:]

        def injected(kind: str, rank: str) -> int:
            """The step at which `kind` struck `rank` (one request at a time: inject.json)."""
            r = a.ctl("inject", "uc", kind, "--rank", rank)
            assert r.returncode == 0, r.stderr
            deadline = time.monotonic() + 120
            while not (struck := [e["step"] for e in a.events("uc")
                                  if e["cause"] == f"injected_{kind}"]):
                assert time.monotonic() < deadline, a.events("uc")
                time.sleep(0.2)
            return int(struck[0])

        # rank 1 computes 0.1 s slower a micro-batch from now on: the DP 2 group cannot train
        # to its end while the events reach the test, however loaded the machine
        injected("slow", "1")
        # every save from the step the injection struck on carries the pattern: the restore
        # at DP 1 meets one of them
        spoiled = -(-injected("unconvertible", "0") // 5) * 5
        manifests = store / "uc" / "ckpt"
        deadline = time.monotonic() + 300
        while max((int(m.parent.name.removeprefix("step-"))
                   for m in manifests.glob("step-*/MANIFEST.json")), default=-1) < spoiled:
            assert time.monotonic() < deadline, a.ctl("logs", "uc").stdout[-5000:]
            time.sleep(0.05)

        b.kill()  # node b dies: its daemon, then its agent and worker, all by SIGKILL
        kill_job_processes(b.state_dir)
        paused = a.wait_state("uc", "PAUSED", "FAILED", "COMPLETED", timeout_s=400)
        assert paused["state"] == "PAUSED", a.ctl("logs", "uc").stdout[-5000:]
        message = paused["message"]
        m = re.search(r"checkpoint step (\d+) could not be converted to this layout "
                      r"\(\(tp,pp,dp\) 1,1,2 -> 1,1,1\) by 2 worker groups: rank 0: "
                      r"AssertionError: Unused patterns", message)
        assert m and int(m.group(1)) >= spoiled, message
        kept = int(m.group(1))
        assert "every older checkpoint needs the same conversion" in message, message
        assert "Bring back the layout it was saved with" in message, message
        events = a.events("uc")
        assert not [e for e in events if "rollback" in e["message"]], events
        listed = a.ctl("checkpoints", "uc", "--json")
        assert kept in [c["step"] for c in json.loads(listed.stdout)], listed

        b.argv[b.argv.index("--listen") + 1] = b.addr  # node b returns on its address
        b.start()
        r = a.ctl("resume", "uc")
        assert r.returncode == 0, r.stderr
        done = a.wait_state("uc", "COMPLETED", "FAILED", "PAUSED", timeout_s=400)
        assert done["state"] == "COMPLETED" and done["world_size"] == 2, \
            a.ctl("logs", "uc").stdout[-5000:]
        loaded = [r for r in rank0_records(Path(done["run_dir"]), "checkpoint")
                  if r["phase"] == "loaded"]
        assert (kept, False) in [(r["step"], r["universal"]) for r in loaded], loaded
    finally:
        for d in daemons:
            d.stop()
            kill_job_processes(d.state_dir)
