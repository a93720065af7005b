"""Checkpoints left local-complete but not durable by exited workers are uploaded by ds3dd.

A real ds3dd runs `tiny` at TP 2 into Ceph RGW with `checkpoint.store_wait_s` = 2. radosgw is
SIGKILLed once the first checkpoint is committed, its workers frozen meanwhile so that the job
still trains; the workers finish, wait 2 s for the store and exit, leaving the newer checkpoints
on local disk only. The job must not be COMPLETED: it stays RUNNING, and its status names the
final step and the store's error. ds3dd is SIGKILLed and started again in the middle: it finds
the same backlog in the local markers. Once the gateway is back, the daemon uploads and commits
the backlog (both ranks' parts, rank 0's MANIFEST), and only then is the job COMPLETED: the
newest durable checkpoint is the final step and its files verify against the manifest."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog, CkptState

from test_daemon_support import DaemonProc, frozen_workers, loopback_nodes, worker_procs

pytest_plugins = ["fixtures.s3", "fixtures.rgw"]
pytestmark = [pytest.mark.rgw, pytest.mark.slow, pytest.mark.timeout(600)]

# the outage begins at the first commit, before the job's next step (frozen workers): the
# checkpoints of steps 60 and 90 are left to the backlog
STEPS, INTERVAL = 90, 30
# ds3dd's backlog retries back off up to this (--backlog-retry-max, default 30 s): once the
# gateway is back, the next attempt comes within it
RETRY_MAX_S = 4.0
DAEMON_ARGS = ["--backlog-retry-max", str(RETRY_MAX_S)]


def _manifest_exists(client: Any, bucket: str, step: int, name: str = "bk") -> bool:
    key = f"jobs/{name}/{layout.manifest_key(step)}"
    return bool(client.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount"))


def _wait_for_first_commit(daemon: Any, client: Any, bucket: str, name: str,
                           timeout_s: float) -> None:
    """Until the job's first checkpoint (step INTERVAL) is committed in the store: the outage
    of each test starts after it, so an older durable checkpoint always exists."""
    deadline = time.monotonic() + timeout_s
    while not _manifest_exists(client, bucket, INTERVAL, name):
        assert time.monotonic() < deadline, daemon.job(name)
        time.sleep(0.05)


@contextlib.contextmanager
def _outage_from_first_commit(rgw_cluster: Any, daemon: Any, client: Any, bucket: str,
                              name: str, workers: dict[Path, int],
                              timeout_s: float) -> Iterator[None]:
    """The gateway down (SIGKILL) from the job's first commit on: its `workers` (run dir ->
    count) are frozen from the moment the commit is seen until radosgw is gone, so the outage
    begins before the job's next step however fast it trains or however loaded the host."""
    _wait_for_first_commit(daemon, client, bucket, name, timeout_s)
    with contextlib.ExitStack() as outage:
        with contextlib.ExitStack() as frozen:
            for run_dir, count in workers.items():
                frozen.enter_context(frozen_workers(run_dir, count))
            outage.enter_context(rgw_cluster.gateway_down())
        yield


def test_backlog_is_uploaded_by_the_daemon_after_the_workers_exit(
        rgw_cluster: Any, rgw_server: Any, rgw_bucket: str, make_rgw_storage: Any,
        tmp_path: Path) -> None:
    env = {**rgw_server.env(), "DS3D_S3_MAX_ATTEMPTS": "1", "DS3D_S3_OUTAGE_RETRIES": "1"}
    d = DaemonProc(tmp_path / "state", extra_env=env, args=DAEMON_ARGS)
    with d:
        r = d.ctl("start", "tiny", "--name", "bk", "--tp", "2", "--steps", str(STEPS),
                  "--set", f"checkpoint.interval={INTERVAL}",
                  "--set", "checkpoint.store_wait_s=2",
                  "--set", f'checkpoint.store="s3://{rgw_bucket}/jobs"')
        assert r.returncode == 0, r.stderr
        run_dir = tmp_path / "state" / "jobs" / "bk"
        client = rgw_server.client()
        with _outage_from_first_commit(rgw_cluster, d, client, rgw_bucket, "bk", {run_dir: 2},
                                       timeout_s=240):
            at_outage = d.job("bk")["step"]
            assert at_outage < STEPS, f"trained to the end ({at_outage}) before the outage"
            # the workers finish, wait store_wait_s and exit; the daemon holds the job
            job = d.wait_for("bk", lambda j: "final checkpoint step" in j["message"],
                             "the backlog named in the status", timeout_s=240)
            assert job["state"] == "RUNNING", job
            assert f"final checkpoint step {STEPS} waits for the store" in job["message"], job
            assert "pending" in job["message"], job
            assert not worker_procs(run_dir), "the workers should have exited"
            status = d.ctl("status", "bk", "--json")
            assert f"final checkpoint step {STEPS} waits for the store: " in status.stdout, \
                status.stdout
            assert "cannot reach the S3 endpoint" in status.stdout, status.stdout
            # a daemon crash in the middle: the restarted daemon finds the backlog on disk
            d.kill()
            d.start()
            d.wait_for("bk", lambda j: sum(
                1 for e in d.events("bk") if e.get("cause") == "backlog") >= 2,
                "the restarted daemon resuming the backlog", timeout_s=60)
            time.sleep(3.0)  # its uploads fail and are retried while the gateway is down
            job = d.job("bk")
            assert job["state"] == "RUNNING", job
            assert f"final checkpoint step {STEPS} waits for the store" in job["message"], job
        done = d.wait_state("bk", "COMPLETED", "FAILED", "STOPPED", timeout_s=180)
        assert done["state"] == "COMPLETED", done
        assert done["last_checkpoint_step"] == STEPS, done
        assert done["restarts"] == 0, done
        events = d.event_details("bk")
    durable = [e for e in events if e.get("cause") == "backlog_durable"]
    assert len(durable) == 1 and STEPS in durable[0]["detail"]["committed"], durable
    assert not [e for e in events if e["kind"] == "fault"], events
    assert done["step"] == STEPS, done
    # the store's newest durable checkpoint is the final step, and it verifies
    catalog = Catalog(make_rgw_storage("jobs/bk"), None)
    committed = [c.step for c in catalog.list() if c.state is CkptState.COMMITTED]
    assert max(committed) == STEPS, committed
    assert catalog.verify(STEPS, checksums=True) == [], catalog.verify(STEPS, checksums=True)


def test_each_node_uploads_its_ranks_and_rank_0s_node_commits(
        rgw_cluster: Any, rgw_server: Any, rgw_bucket: str, make_rgw_storage: Any,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two daemons as two nodes (DP 2): global rank 0 runs on B, the share node, rank 1 on the
    head A. After the workers exit during the outage, A uploads rank 1's files and B's daemon
    rank 0's, and B commits; A keeps the job RUNNING until the final MANIFEST is in the store."""
    env = {**rgw_server.env(), "DS3D_S3_MAX_ATTEMPTS": "1", "DS3D_S3_OUTAGE_RETRIES": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with loopback_nodes(tmp_path, *DAEMON_ARGS) as (a, b):
        r = a.ctl("start", "tiny", "--name", "mb", "--dp", "2", "--steps", str(STEPS),
                  "--hosts", f"{a.addr},{b.addr}",
                  "--set", f"checkpoint.interval={INTERVAL}",
                  "--set", "checkpoint.store_wait_s=2",
                  "--set", f'checkpoint.store="s3://{rgw_bucket}/jobs"')
        assert r.returncode == 0, r.stderr
        client = rgw_server.client()
        head_dir, share_dir = a.state_dir / "jobs" / "mb", b.state_dir / "shares" / "mb"
        with _outage_from_first_commit(rgw_cluster, a, client, rgw_bucket, "mb",
                                       {head_dir: 1, share_dir: 1}, timeout_s=300):
            assert a.job("mb")["step"] < STEPS, "trained to the end before the outage"
            job = a.wait_for("mb", lambda j: "final checkpoint step" in j["message"],
                             "the backlog named in the status", timeout_s=300)
            assert job["state"] == "RUNNING", job
            assert f"final checkpoint step {STEPS} waits for the store" in job["message"], job
            deadline = time.monotonic() + 60
            while worker_procs(head_dir) or worker_procs(share_dir):
                assert time.monotonic() < deadline, "the workers should have exited"
                time.sleep(0.5)
        done = a.wait_state("mb", "COMPLETED", "FAILED", "STOPPED", timeout_s=240)
        assert done["state"] == "COMPLETED", done
        assert done["step"] == STEPS and done["last_checkpoint_step"] == STEPS, done
    # rank 0 (and so the commit) was on B: B's daemon uploaded its part and committed
    rank0 = (share_dir / "reports" / "rank-00000.jsonl").read_text()
    assert f'"step":{STEPS},"phase":"committed","source":"ds3dd"' in rank0
    rank1 = (head_dir / "reports" / "rank-00001.jsonl").read_text()
    assert f'"step":{STEPS},"phase":"uploaded","source":"ds3dd"' in rank1
    catalog = Catalog(make_rgw_storage("jobs/mb"), None)
    committed = [c.step for c in catalog.list() if c.state is CkptState.COMMITTED]
    assert max(committed) == STEPS, committed
    assert catalog.verify(STEPS, checksums=True) == []


def _rank_records(run_dir: Path, rank: int) -> str:
    """The text of one rank's report records on a node (every segment of its file)."""
    return "".join(p.read_text() for p in sorted((run_dir / "reports").glob(
        f"rank-{rank:05d}*.jsonl")))


def test_a_restarted_share_daemon_resumes_its_backlog(
        rgw_cluster: Any, rgw_server: Any, rgw_bucket: str, make_rgw_storage: Any,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DP 2 with rank 0 on the share node B, as above. During the outage B's ds3dd starts the
    backlog of its exited share and is SIGKILLed; the gateway comes back while B is down: the
    head uploads rank 1's part but keeps the job RUNNING, its status naming the commit it waits
    for and the node that does not answer. The head's ds3dd is SIGKILLed and started again: it
    has nothing left to upload, yet it still waits for that commit. B's ds3dd is started again
    (same state dir and address): it finds the share's exited agent and its pending
    checkpoints, uploads rank 0's part and commits, and only then is the job COMPLETED."""
    env = {**rgw_server.env(), "DS3D_S3_MAX_ATTEMPTS": "1", "DS3D_S3_OUTAGE_RETRIES": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with loopback_nodes(tmp_path, *DAEMON_ARGS) as (a, b):
        r = a.ctl("start", "tiny", "--name", "rs", "--dp", "2", "--steps", str(STEPS),
                  "--hosts", f"{a.addr},{b.addr}",
                  "--set", f"checkpoint.interval={INTERVAL}",
                  "--set", "checkpoint.store_wait_s=2",
                  "--set", f'checkpoint.store="s3://{rgw_bucket}/jobs"')
        assert r.returncode == 0, r.stderr
        client = rgw_server.client()
        head_dir, share_dir = a.state_dir / "jobs" / "rs", b.state_dir / "shares" / "rs"
        with _outage_from_first_commit(rgw_cluster, a, client, rgw_bucket, "rs",
                                       {head_dir: 1, share_dir: 1}, timeout_s=300):
            assert a.job("rs")["step"] < STEPS, "trained to the end before the outage"
            a.wait_for("rs", lambda j: "final checkpoint step" in j["message"],
                       "the backlog named in the status", timeout_s=300)
            # B's ds3dd tries rank 0's final checkpoint itself (its workers have exited)
            failed = f'"step":{STEPS},"phase":"failed","source":"ds3dd"'
            deadline = time.monotonic() + 120
            while failed not in _rank_records(share_dir, 0):
                assert time.monotonic() < deadline, "B's ds3dd did not start its backlog"
                time.sleep(0.5)
            assert not worker_procs(share_dir), "B's workers should have exited"
            b.kill()
        # the store is back, B's ds3dd is not: the head's part goes in, the commit waits
        job = a.wait_for("rs", lambda j: "waits for the node of rank 0" in j["message"]
                         and "do not answer" in j["message"],
                         "the head waiting for rank 0's node", timeout_s=120)
        assert job["state"] == "RUNNING", job
        assert f"{STEPS}] (node(s) {b.addr} do not answer)" in job["message"], job
        assert not _manifest_exists(client, rgw_bucket, STEPS, "rs")
        assert f'"step":{STEPS},"phase":"committed"' not in _rank_records(share_dir, 0)
        # the head's ds3dd crashes too: nothing is left to upload there, but the restarted
        # daemon still waits for rank 0's node to commit the final step
        a.kill()
        a.argv[a.argv.index("--listen") + 1] = a.addr  # the address in the job's hosts
        a.start()
        job = a.wait_for("rs", lambda j: j["state"] != "RUNNING" or sum(
            1 for e in a.events("rs") if e.get("cause") == "backlog") >= 2,
            "the restarted head waiting again", timeout_s=120)
        assert job["state"] == "RUNNING", job
        job = a.wait_for("rs", lambda j: j["state"] != "RUNNING" or f"commit steps [{STEPS}] "
                         f"(node(s) {b.addr} do not answer)" in j["message"],
                         "the restarted head naming the commit it waits for", timeout_s=60)
        assert job["state"] == "RUNNING", job
        assert not _manifest_exists(client, rgw_bucket, STEPS, "rs")
        b.argv[b.argv.index("--listen") + 1] = b.addr  # the address the head calls
        b.start()
        done = a.wait_state("rs", "COMPLETED", "FAILED", "STOPPED", timeout_s=240)
        assert done["state"] == "COMPLETED", done
        assert done["step"] == STEPS and done["last_checkpoint_step"] == STEPS, done
        durable = [e for e in a.events("rs") if e.get("cause") == "backlog_durable"]
        assert len(durable) == 1, durable  # by the restarted head
        assert f"[{STEPS}] committed by the node of rank 0" in durable[0]["message"], durable
    # B's restarted ds3dd committed the final step; the head uploaded rank 1's part
    assert f'"step":{STEPS},"phase":"committed","source":"ds3dd"' in \
        _rank_records(share_dir, 0)
    assert f'"step":{STEPS},"phase":"uploaded","source":"ds3dd"' in \
        _rank_records(head_dir, 1)
    catalog = Catalog(make_rgw_storage("jobs/rs"), None)
    committed = [c.step for c in catalog.list() if c.state is CkptState.COMMITTED]
    assert max(committed) == STEPS, committed
    assert catalog.verify(STEPS, checksums=True) == []


def test_stop_now_does_not_wait_and_names_the_local_only_steps(
        rgw_cluster: Any, rgw_server: Any, rgw_bucket: str, tmp_path: Path) -> None:
    """`stop --now` while the daemon waits for the store ends the job STOPPED at once; its
    message names the checkpoints left only on the local tier."""
    env = {**rgw_server.env(), "DS3D_S3_MAX_ATTEMPTS": "1", "DS3D_S3_OUTAGE_RETRIES": "1"}
    with DaemonProc(tmp_path / "state", extra_env=env, args=DAEMON_ARGS) as d:
        r = d.ctl("start", "tiny", "--name", "sn", "--steps", str(STEPS),
                  "--set", f"checkpoint.interval={INTERVAL}",
                  "--set", "checkpoint.store_wait_s=2",
                  "--set", f'checkpoint.store="s3://{rgw_bucket}/jobs"')
        assert r.returncode == 0, r.stderr
        client = rgw_server.client()
        with _outage_from_first_commit(rgw_cluster, d, client, rgw_bucket, "sn",
                                       {tmp_path / "state" / "jobs" / "sn": 1}, timeout_s=240):
            assert d.job("sn")["step"] < STEPS, "trained to the end before the outage"
            d.wait_for("sn", lambda j: "final checkpoint step" in j["message"],
                       "the backlog named in the status", timeout_s=240)
            r = d.ctl("stop", "sn", "--now")
            assert r.returncode == 0, r.stderr
            done = d.wait_state("sn", "STOPPED", "COMPLETED", "FAILED", timeout_s=60)
        assert done["state"] == "STOPPED", done
        assert "stay only in this node's local tier" in done["message"], done
        assert f"{STEPS}]" in done["message"], done
        assert not _manifest_exists(client, rgw_bucket, STEPS, "sn")


def test_stop_now_ends_the_share_nodes_backlog_too(
        rgw_cluster: Any, rgw_server: Any, rgw_bucket: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DP 2 with rank 0 on the share node B: `stop --now` while both nodes wait for the store
    ends the job STOPPED, and B's ds3dd stops uploading too (StopShare closes its backlog):
    once the gateway is back, no part of the outage's steps comes from B within more than the
    longest retry interval (RETRY_MAX_S)."""
    env = {**rgw_server.env(), "DS3D_S3_MAX_ATTEMPTS": "1", "DS3D_S3_OUTAGE_RETRIES": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with loopback_nodes(tmp_path, *DAEMON_ARGS) as (a, b):
        r = a.ctl("start", "tiny", "--name", "ss", "--dp", "2", "--steps", str(STEPS),
                  "--hosts", f"{a.addr},{b.addr}",
                  "--set", f"checkpoint.interval={INTERVAL}",
                  "--set", "checkpoint.store_wait_s=2",
                  "--set", f'checkpoint.store="s3://{rgw_bucket}/jobs"')
        assert r.returncode == 0, r.stderr
        client = rgw_server.client()
        share_dir = b.state_dir / "shares" / "ss"
        failed = f'"step":{STEPS},"phase":"failed","source":"ds3dd"'
        with _outage_from_first_commit(rgw_cluster, a, client, rgw_bucket, "ss",
                                       {a.state_dir / "jobs" / "ss": 1, share_dir: 1},
                                       timeout_s=300):
            assert a.job("ss")["step"] < STEPS, "trained to the end before the outage"
            a.wait_for("ss", lambda j: "final checkpoint step" in j["message"],
                       "the backlog named in the status", timeout_s=300)
            deadline = time.monotonic() + 120
            while failed not in _rank_records(share_dir, 0):  # B's backlog runs
                assert time.monotonic() < deadline, "B's ds3dd did not start its backlog"
                time.sleep(0.5)
            r = a.ctl("stop", "ss", "--now")
            assert r.returncode == 0, r.stderr
            done = a.wait_state("ss", "STOPPED", "COMPLETED", "FAILED", timeout_s=60)
            assert done["state"] == "STOPPED", done
            # the head's StopShare follows the transition; B marks the share ended once its
            # backlog is closed (an attempt in flight finished, failing: the gateway is down)
            deadline = time.monotonic() + 30
            while not (share_dir / "control" / "share-stopped.json").is_file():
                assert time.monotonic() < deadline, "B was not told the job ended"
                time.sleep(0.2)
        # B's backlog, were it still running, retries within RETRY_MAX_S (and 10 s to upload)
        time.sleep(RETRY_MAX_S + 10.0)
        for step in range(2 * INTERVAL, STEPS + 1, INTERVAL):  # those of the outage
            part = f"jobs/ss/{layout.part_key(step, 0)}"
            assert not client.list_objects_v2(Bucket=rgw_bucket, Prefix=part).get("KeyCount"), \
                part
        assert '"phase":"uploaded","source":"ds3dd"' not in _rank_records(share_dir, 0)
    assert not _manifest_exists(client, rgw_bucket, STEPS, "ss")
