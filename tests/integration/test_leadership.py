"""The etcd leader lease (daemon/leadership.py) between two real contender processes and a real
etcd: one leader at a time, by etcd's record and by the processes' own reports; a leader frozen
by SIGSTOP loses the lease, the other takes over once the key expired, and the old one, thawed,
reports that its term ended before the new one began and follows.

Heavy: `flock /tmp/ds3d-heavy.lock .venv/bin/pytest -q tests/integration/test_leadership.py`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ds3d.daemon.job_leadership import JobRecord, Leadership, job_key, job_key_of_run_id
from ds3d.daemon.rendezvous import rendezvous_run_id
from ds3d.daemon.states import JobState
from ds3d.daemon.store import Store

pytest_plugins = ["fixtures.etcd"]
pytestmark = [pytest.mark.etcd, pytest.mark.timeout(120)]

KEY = "/ds3d/test/leader"
TTL = 5  # renewed every TTL/4; a holder acts for at most 3/4 TTL past its last renewal


class Contender:
    def __init__(self, endpoint: str, holder: str) -> None:
        self.holder = holder
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ds3d.daemon.leadership", "--endpoint", endpoint,
             "--key", KEY, "--holder", holder, "--ttl", str(TTL)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.records: list[dict] = []
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("{"):
                self.records.append(json.loads(line))

    def role(self) -> str | None:
        return self.records[-1]["role"] if self.records else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait(pred, what: str, timeout_s: float, sample=None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sample is not None:
            sample()
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_one_leader_at_a_time_and_takeover_after_the_leader_freezes(etcd_server):
    import etcd

    client = etcd_server.client()
    contenders = [Contender(etcd_server.endpoint, "node-a"), Contender(etcd_server.endpoint,
                                                                       "node-b")]
    holders_seen: list[str | None] = []  # etcd's record, sampled while the test runs

    def sample() -> None:
        try:
            holders_seen.append(client.read(KEY).value)
        except etcd.EtcdKeyNotFound:
            holders_seen.append(None)

    try:
        wait(lambda: any(c.role() == "leader" for c in contenders), "a leader", 30, sample)
        time.sleep(TTL)  # both keep running: the leader renews, the other keeps waiting
        sample()
        (old,) = [c for c in contenders if c.role() == "leader"]
        (new,) = [c for c in contenders if c is not old]
        assert new.records == [], new.lines
        assert client.read(KEY).value == old.holder
        old_token = old.records[-1]["token"]
        assert client.read(KEY).createdIndex == old_token  # the fencing token is etcd's index

        os.kill(old.proc.pid, signal.SIGSTOP)  # it stops renewing and cannot act
        wait(lambda: new.role() == "leader", "the takeover", 4 * TTL, sample)
        took = new.records[-1]
        assert took["token"] > old_token and client.read(KEY).value == new.holder

        os.kill(old.proc.pid, signal.SIGCONT)
        wait(lambda: old.role() == "follower", "the old leader to step down", 3 * TTL, sample)
        left = old.records[-1]
        assert left["token"] == old_token
        # the processes' own word: the old term ended before the new one began (one clock)
        assert left["until"] < took["since"], (old.records, new.records)
        time.sleep(TTL)  # thawed, it follows: no second takeover
        sample()
        assert old.role() == "follower" and new.role() == "leader"
        assert client.read(KEY).value == new.holder
        assert [r["role"] for r in old.records] == ["leader", "follower"]
        assert [r["role"] for r in new.records] == ["leader"]
    finally:
        for c in contenders:
            c.stop()
    # etcd's record: one holder at a time, old before new, never back to the old one
    named = [h for i, h in enumerate(holders_seen) if h is not None and
             (i == 0 or h != holders_seen[i - 1])]
    named = [h for i, h in enumerate(named) if i == 0 or h != named[i - 1]]
    assert named == [old.holder, new.holder], holders_seen


def test_a_deposed_leaders_record_write_is_refused_by_etcd(etcd_server, tmp_path):
    """The job record's fencing (daemon/job_leadership.py): a leader whose lease ran out while
    it was frozen still believes it leads (its clock stood still: the worst case), but once a
    successor has written the record, etcd refuses the old leader's compare-and-swap; the old
    leader learns who deposed it and stops. The record's key is the run ids' prefix."""
    job_id = "0123456789abcdef" * 2
    key = job_key("fo-a1", job_id)  # a name that itself looks like a run id's tail
    assert job_key_of_run_id(rendezvous_run_id("fo-a1", 7, job_id, etcd=True)) == key

    store = Store(tmp_path / "ds3d.db")
    store.create_job("fo-a1", "{}", "node-a", str(tmp_path), job_id=job_id)
    job = store.get_job("fo-a1")
    frozen = [time.monotonic()]
    old = Leadership(etcd_server.client(), key, "node-a", ttl_s=2, clock=lambda: frozen[0])
    assert old.hold() and old.publish(job, store)
    old._stop_renewing.set()  # frozen: no more renewals; its own clock stands still
    new = Leadership(etcd_server.client(), key, "node-b", ttl_s=2)
    deadline = time.monotonic() + 10
    while not new.hold():
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.2)
    assert new.lease.term is not None and old.lease.term is not None
    assert new.lease.term.token > old.lease.term.token
    assert old.lease.is_leader()  # by its own stopped clock it still leads...
    assert new.publish(store.update("fo-a1", restarts=1), store)
    # ... but its write is refused by etcd, and it knows by whom
    assert not old.publish(store.update("fo-a1", restarts=2), store, force=True)
    assert old.deposed_by == "node-b" and old.lease.term is None
    record = JobRecord.parse(etcd_server.client().read(f"{key}/record").value)
    assert (record.leader, record.restarts, record.token) == \
        ("node-b", 1, new.lease.term.token)
    assert record.state == JobState.PENDING.name and record.live
    new.release()
    store.close()


def test_a_share_of_an_ended_job_is_never_told_its_head_is_being_replaced(etcd_server,
                                                                          tmp_path,
                                                                          monkeypatch):
    """A job's leader writes the terminal record, then gives its lease up. A share's takeover
    watch that reads the lease in between finds nobody holding it: it must not tell the
    node's clients the head "is being replaced" (a job that ended has no successor) while it
    reads the record, and once it has, calls go to the job's first host again. (A CI run
    failed the head-failover drill on that window: the other survivor's GetJob right after
    COMPLETED was refused as retryable.)"""
    from ds3d.daemon import takeover
    from ds3d.daemon.jobdir import JobDir
    from ds3d.daemon.launcher import Launcher
    from ds3d.daemon.peers import Shares
    from ds3d.trainer.config import build_job_config

    hosts = '["127.0.0.1:7000", "127.0.0.1:7001"]'
    cfg = build_job_config("tiny", [f"launch.hosts={hosts}", "launch.nnodes=2", "parallel.dp=2",
                                    'checkpoint.store="file:///tmp/x"',
                                    f'launch.rendezvous="{etcd_server.url}"'], name="fo")
    JobDir(tmp_path / "shares", "fo").create(cfg.dump_json())
    shares = Shares(tmp_path / "shares", Launcher())
    job_id = "fedcba9876543210" * 2
    run_id = rendezvous_run_id("fo", 1, job_id, etcd=True)
    key = job_key_of_run_id(run_id)

    store = Store(tmp_path / "ds3d.db")
    store.create_job("fo", cfg.dump_json(), "node-a", str(tmp_path), job_id=job_id)
    leader = Leadership(etcd_server.client(), key, "127.0.0.1:7000")
    assert leader.hold() and leader.publish(store.get_job("fo"), store)
    shares.leader_seen("fo", "127.0.0.1:7000")  # the watch's reading while the job trained
    assert shares.head_address("fo") == "127.0.0.1:7000"
    # the job ends: terminal record first, then the lease given up
    client = etcd_server.client()
    record = JobRecord.parse(client.read(f"{key}/record").value)
    record.state = record.desired_state = JobState.COMPLETED.name
    client.write(f"{key}/record", record.dump())
    leader.release()

    answers = []
    real_read_record = takeover.read_record

    def read_record_while_clients_call(client, k):
        answers.append(shares.head_address("fo"))  # raises HeadReplacingError if refused
        return real_read_record(client, k)

    monkeypatch.setattr(takeover, "read_record", read_record_while_clients_call)
    standby = takeover.Standby(store, shares, tmp_path / "jobs", "node-b",
                               adopt=lambda *a: pytest.fail("an ended job was taken over"),
                               address=lambda: "127.0.0.1:7001")
    standby._check(cfg, run_id)
    assert answers == ["127.0.0.1:7000"]  # the record was read, nobody refused meanwhile
    assert not shares.etcd_led("fo") and shares.head_address("fo") == "127.0.0.1:7000"
    store.close()
