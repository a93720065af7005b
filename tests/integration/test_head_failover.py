"""An etcd-mode job survives the loss of its head node (issue 23): three daemons as three nodes
on loopback and a 3-member etcd cluster. Mid-job the head node dies whole (its daemon, agent and
workers, and its etcd member, all by SIGKILL). One survivor takes the job's lease once it has
expired, leads the job from etcd's record (configuration, job id, restarts, events), relaunches
it on the two nodes left from the newest committed checkpoint reshaped to DP 2, and the job
completes with the losses of a reference that goes the same DP 3 -> 2 way.

Heavy: `flock /tmp/ds3d-heavy.lock .venv/bin/pytest -q tests/integration/test_head_failover.py`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from ds3d.daemon.job_leadership import JobRecord

from support import losses, torchrun
from test_daemon_support import (
    DaemonProc,
    frozen_workers,
    kill_job_processes,
    new_token,
    wait_for_commit,
)

pytest_plugins = ["fixtures.etcd"]
pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.timeout(900)]


def rank0_starts(root: Path) -> list[dict]:
    """Every rank-0 `start` record any node wrote (its own reports, not the copies a leader
    pulled), oldest first: the job's path through world sizes."""
    starts = []
    for path in root.glob("*/*/*/reports/rank-00000.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "start":
                starts.append(rec)
    return sorted(starts, key=lambda r: r["time"])


@pytest.fixture
def cluster(etcd_cluster, tmp_path):
    """A 3-member etcd cluster and three daemons as three nodes (a, b, c) on loopback."""
    members = etcd_cluster(3)
    token = new_token()
    daemons = [DaemonProc(tmp_path / n, token=token, node=f"node-{n}",
                          args=["--hang-timeout", "120", "--node-addr", f"127.0.0.{i + 1}"])
               for i, n in enumerate("abc")]
    try:
        for d in daemons:
            d.start()
        yield members, daemons
    finally:
        for d in daemons:
            if d.proc is not None and d.proc.poll() is None:
                os.kill(d.proc.pid, signal.SIGCONT)
            d.stop()
        for d in daemons:
            kill_job_processes(d.state_dir)


def start_job(members, daemons, store: Path, steps: int) -> None:
    """The elastic DP 3 job `fo` on the three nodes, headed by a, its rendezvous in etcd;
    returns once its checkpoint of step 10 is committed."""
    a = daemons[0]
    rendezvous = "etcd://" + ",".join(m.endpoint for m in members)
    r = a.ctl("start", "tiny", "--name", "fo", "--dp", "3", "--steps", str(steps),
              "--set", "launch.min_nodes=2", "--set", "train.micro_batch_size=1",
              "--set", "train.global_batch_size=6", "--set", "checkpoint.interval=10",
              "--set", "train.warmup_steps=2", "--set", f"launch.rendezvous={rendezvous}",
              "--hosts", ",".join(d.addr for d in daemons), "--store", f"file://{store}")
    assert r.returncode == 0, r.stderr
    wait_for_commit(a, store, "fo", 10)


def new_leader(client, key: str, candidates: list[DaemonProc]) -> DaemonProc:
    """The candidate etcd names as the job's lease holder, once its job is stored there (the
    lease is won first, then the job stored)."""
    holder = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and holder not in [d.addr for d in candidates]:
        try:
            holder = client.read(f"{key}/leader", quorum=True).value
        except Exception:  # noqa: BLE001 - nobody holds it yet
            holder = ""
        time.sleep(0.2)
    leader = next((d for d in candidates if d.addr == holder), None)
    assert leader is not None, holder
    while not (leader.state_dir / "jobs" / "fo" / "job_id").is_file() and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    return leader


def survivors_answer_through_the_gap(survivors: list[DaemonProc]) -> list[str]:
    """GetJob on each survivor, from the head's death until every one serves the job as its
    new leader has it (the job's node one of the survivors'); the refusals met on the way."""
    nodes = {d.argv[d.argv.index("--node-name") + 1] for d in survivors}
    refusals: list[str] = []
    deadline = time.monotonic() + 120
    while True:
        seen = []
        for d in survivors:
            try:
                seen.append(d.job("fo")["node"])
            except AssertionError as e:  # GetJob refused: code and message
                refusals.append(str(e))
        if len(seen) == len(survivors) and set(seen) <= nodes:
            return refusals
        assert time.monotonic() < deadline, (seen, refusals[-3:])
        time.sleep(0.3)


def test_head_node_lost_a_survivor_leads_and_the_job_completes(cluster, tmp_path):
    members, daemons = cluster
    a, b, c = daemons
    steps = 60
    start_job(members, daemons, tmp_path / "shared-store", steps)
    before = a.job("fo")
    assert before["world_size"] == 3 and before["step"] < steps - 20, before

    # the head node dies whole: daemon, agent, workers and its etcd member
    a.kill()
    kill_job_processes(a.state_dir)
    members[0].stop(sig_kill=True)

    # through the gap each survivor answers for the job: forwarded to the lease holder, or
    # refused as retryable with the reason (head not answering, or being replaced), never
    # with a bare UNAVAILABLE; then both forward to (or are) the new leader
    refusals = survivors_answer_through_the_gap([b, c])
    for refusal in refusals:
        assert "UNAVAILABLE" in refusal and "retry in a few seconds" in refusal, refusal

    # etcd says who leads now: one of the survivors, once the lease (6 s) ran out
    client = members[1].client()
    key = _job_key(client, "fo")
    leader = new_leader(client, key, [b, c])
    other = c if leader is b else b
    leader_addr = leader.addr

    done = leader.wait_state("fo", "COMPLETED", "FAILED", timeout_s=500)
    assert done["state"] == "COMPLETED", leader.ctl("logs", "fo").stdout[-5000:]
    assert done["step"] == steps and done["world_size"] == 2, done
    # the new leader's launches went on from the old leader's attempts: a fresh run id (a
    # rendezvous the old group used is closed, or still held by its survivors)
    specs = sorted((Path(done["run_dir"]) / "control").glob("agent-*.json"))
    assert specs and all(int(p.stem.split("-")[1]) >= 2 for p in specs), specs
    # the other survivor shows the job as the leader does (its calls are forwarded)
    assert other.job("fo")["state"] == "COMPLETED"
    assert other.ctl("status").returncode == 0

    events = leader.events("fo")
    # the old leader's events came along through etcd
    assert any(e["kind"] == "launch" and e["node"] == "node-a" for e in events), events
    lost = [e for e in events if e["kind"] == "fault" and e["cause"] == "leader_lost"]
    assert len(lost) == 1 and leader_addr in lost[0]["message"], lost
    recovered = [e for e in events if e["kind"] == "recovered"
                 and e["cause"] == "leader_lost"]
    assert len(recovered) == 1, events
    assert re.search(r"noticed [\d.]+ s after the last step \(daemon\), training again "
                     r"[\d.]+ s later from step \d+", recovered[0]["message"]), recovered
    # etcd's record: the new leader's, terminal, with a later token than the old one's
    record = JobRecord.parse(client.read(f"{key}/record", quorum=True).value)
    assert record.leader == leader_addr and record.state == "COMPLETED"
    lost_detail = next(e["detail"] for e in leader.event_details("fo")
                       if e["kind"] == "fault" and e["cause"] == "leader_lost")
    assert record.token > lost_detail["old_token"] > 0

    # the losses: DP 3 until the first DP 2 start, DP 2 from there (a resume at the same
    # DP repeats the same steps exactly)
    starts = rank0_starts(tmp_path)
    worlds = [s["world_size"] for s in starts]
    assert worlds[0] == 3 and worlds[-1] == 2, starts
    shrunk = next(s for s in starts if s["world_size"] == 2)
    assert shrunk["step"] >= 10 and starts[-1]["step"] >= 10
    # rank 0 of the last group ran on one of the two survivors (the leader pulls its
    # records into reports/nodes/ when it is the other one)
    rank0 = sorted(Path(done["run_dir"]).glob("reports/**/rank-00000.jsonl"))
    got = {}
    for path in rank0:
        got.update({r["step"]: r["loss"] for r in map(json.loads, path.read_text().split(
            "\n")[:-1]) if r["kind"] == "step"})
    assert max(got) == steps and done["step"] == steps
    ref = tmp_path / "ref"
    ref_sets = ["name=fo", "parallel.dp=3", "launch.nnodes=3", "launch.min_nodes=2",
                "train.micro_batch_size=1", "train.global_batch_size=6",
                "train.warmup_steps=2", f"train.steps={steps}", "checkpoint.interval=0"]
    torchrun(ref, 3, sets=ref_sets, extra=["--stop-at-step", str(shrunk["step"])])
    torchrun(ref, 2, sets=ref_sets)
    want = losses(ref)
    for step in sorted(got):
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"step {step}"


def _job_key(client, name: str) -> str:
    """The job's etcd folder (job_key(name, job id)): the one folder of that name."""
    folders = [n.key for n in client.read("/ds3d/jobs").children
               if n.key.rsplit("/", 1)[1].startswith(f"{name}-")]
    assert len(folders) == 1, folders
    return folders[0]


class Watch:
    """etcd's own account of the job's folder: every change (create, compareAndSwap, expire,
    delete...) of every key under /ds3d/jobs, in etcd's order, read by a thread from a member
    that stays up."""

    def __init__(self, client, after_index: int) -> None:
        self.client, self.next_index = client, after_index + 1
        self.changes: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                r = self.client.read("/ds3d/jobs", wait=True, recursive=True,
                                     waitIndex=self.next_index, timeout=2)
            except Exception:  # noqa: BLE001 - a watch timeout: ask again
                continue
            self.changes.append({"action": r.action, "key": r.key, "value": r.value,
                                 "index": int(r.modifiedIndex), "time": time.time()})
            self.next_index = int(r.modifiedIndex) + 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_frozen_head_loses_the_lease_then_follows_and_never_writes_again(cluster, tmp_path):
    """The head's daemon is frozen (SIGSTOP) past its lease and thawed: a survivor leads from
    the lease's expiry on, the thawed daemon follows (forwards the job's calls, writes nothing
    more to etcd) and the job completes under the new leader."""
    members, daemons = cluster
    a, b, c = daemons
    client = members[1].client()
    watch = Watch(client, int(client.read("/").etcd_index))
    try:
        start_job(members, daemons, tmp_path / "shared-store", steps=60)
        key = _job_key(client, "fo")
        assert client.read(f"{key}/leader", quorum=True).value == a.addr

        # the workers are frozen while the lease expires (6 s) and a survivor takes it: the job's
        # last 50 steps must not end under the frozen head on a fast host; thawed once a new
        # leader holds the job, they train on while the old head is still frozen
        with frozen_workers(a.state_dir / "jobs" / "fo", 1), \
                frozen_workers(b.state_dir / "shares" / "fo", 1), \
                frozen_workers(c.state_dir / "shares" / "fo", 1):
            os.kill(a.proc.pid, signal.SIGSTOP)  # the daemon alone: its agent runs on
            leader = new_leader(client, key, [b, c])
        time.sleep(3)  # the new leader is at work while the old one is still frozen
        os.kill(a.proc.pid, signal.SIGCONT)

        done = leader.wait_state("fo", "COMPLETED", "FAILED", timeout_s=500)
        assert done["state"] == "COMPLETED", leader.ctl("logs", "fo").stdout[-5000:]
        assert done["step"] == 60
        # the thawed daemon follows: it forwards the job's calls to the new leader
        seen_from_a = a.job("fo")
        assert seen_from_a["state"] == "COMPLETED" and seen_from_a["run_dir"] == done["run_dir"]
        follow = [e for e in a.events("fo") if e["cause"] == "leader_lost"]
        assert follow, a.events("fo")
    finally:
        watch.stop()

    # etcd's account: the lease had one holder at a time (each create after the previous
    # holder's key expired or was deleted), a then the new leader
    leases = [ch for ch in watch.changes if ch["key"] == f"{key}/leader"]
    holders, held = [], None
    for ch in leases:
        if ch["action"] == "create":
            assert held is None, leases
            held = ch["value"]
            holders.append(held)
        elif ch["action"] in ("expire", "delete", "compareAndDelete"):
            held = None
        else:
            assert ch["value"] == held, leases  # a renewal by the holder itself
    assert holders[:2] == [a.addr, leader.addr], leases
    expired = next(ch for ch in leases if ch["action"] == "expire")
    # no record write by the old leader once its lease had expired
    records = [(ch, JobRecord.parse(ch["value"])) for ch in watch.changes
               if ch["key"] == f"{key}/record" and ch["value"]]
    late = [ch for ch, rec in records if rec.leader == a.addr and ch["index"] > expired["index"]]
    assert not late, ([(ch["index"], ch["action"], JobRecord.parse(ch["value"]).token)
                       for ch in late], [(ch["index"], ch["action"], ch["value"])
                                         for ch in leases if ch["action"] != "compareAndSwap"],
                      a.addr, leader.addr)
    tokens = [rec.token for _, rec in records]
    assert tokens == sorted(tokens) and tokens[-1] > tokens[0], tokens
    # the daemons' own account: a logged that it follows, after the new leader took over
    a_log = [json.loads(line) for line in (a.state_dir / "ds3dd.log").read_text().splitlines()
             if line.startswith("{")]
    assert any(r["event"] == "following" and r.get("leader") == leader.addr for r in a_log)
