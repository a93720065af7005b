"""What ds3d says about its checkpoints is what the store holds (issue 24 items 3-6): a real
ds3dd, real workers (or the contract-following stand-in where only the daemon is under test),
a real store (file, and Ceph RGW where installed)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog
from ds3d.checkpoints.manifest import PartManifest
from ds3d.checkpoints.storage import Storage, open_storage
from ds3d.checkpoints.upload import commit_checkpoint, upload_rank_files

from fixtures.ckpt import meta_for, write_fake_checkpoint
from fixtures.s3 import free_port
from test_daemon_support import DaemonProc, kill_job_processes, pb, tiny_job_json

pytest_plugins = ["fixtures.s3", "fixtures.rgw"]


def start(d: DaemonProc, name: str, **sections: Any) -> None:
    """StartJob through gRPC, as ds3dctl sends it."""
    channel, stub = d.stub()
    with channel:
        stub.StartJob(pb.StartJobRequest(config_json=tiny_job_json(name=name, **sections)),
                      timeout=60)


def checkpoints(d: DaemonProc, name: str, *extra: str) -> dict[int, dict[str, Any]]:
    r = d.ctl("checkpoints", name, "--json", *extra, timeout_s=120)
    assert r.returncode == 0, r.stderr
    return {c["step"]: c for c in json.loads(r.stdout)}


def metric(d: DaemonProc, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    port = d.argv[d.argv.index("--metrics-port") + 1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def wait(what: str, pred, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := pred():
            return got
        time.sleep(0.3)
    raise AssertionError(f"{what}: not after {timeout_s} s")


def flip_a_byte(storage: Storage, key: str, tmp: Path) -> None:
    """Same size, other bytes: only a sha256 can tell."""
    storage.get_file(key, tmp)
    data = bytearray(tmp.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tmp.write_bytes(bytes(data))
    storage.put_file(tmp, key)


@pytest.fixture(params=["file", pytest.param("rgw", marks=pytest.mark.rgw)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str], Any]:
    """(checkpoint.store URL, environment for ds3dd, prefix -> Storage of that prefix)."""
    if request.param == "file":
        url = f"file://{tmp_path}/store"
        return url, {}, lambda prefix: open_storage(f"{url}/{prefix}")
    rgw = request.getfixturevalue("rgw_server")
    bucket = request.getfixturevalue("rgw_bucket")
    return (f"s3://{bucket}/jobs", rgw.env(),
            lambda prefix: rgw.storage(bucket, f"jobs/{prefix}"))


@pytest.mark.timeout(300)
def test_the_index_is_reconciled_on_restart_and_verified_on_demand(tmp_path: Path, store) -> None:
    """Item 4. The workers reported step S `saved` but its commit reached the store unreported
    (the daemon's index said so after an outage mid-commit); step T is committed; while ds3dd
    is down T loses a file. The restarted ds3dd corrects both rows from the store, with an
    event and a metric each; `ds3dctl checkpoints --verify` then finds a byte flipped in S."""
    url, env, prefix_storage = store
    d = DaemonProc(tmp_path / "state", worker_dir=tmp_path / "w",
                   extra_env={**env, "FAKE_STEP_S": "0.5"},
                   args=["--metrics-port", str(free_port())])
    try:
        d.start()
        start(d, "recon", train={"steps": 100000}, checkpoint={"store": url})
        d.wait_state("recon", "RUNNING")
        assert d.ctl("save", "recon").returncode == 0
        saved = wait("a saved checkpoint in the index", lambda: [
            s for s, c in checkpoints(d, "recon").items() if c["phase"] == "saved"])
        s_step = saved[0]
        job_id = (d.state_dir / "jobs" / "recon" / "job_id").read_text().strip()
        storage = prefix_storage("recon")
        t_step = s_step + 1000
        for step in (s_step, t_step):  # what the workers' uploader commits
            files = write_fake_checkpoint(tmp_path / "local", step)[0]
            upload_rank_files(storage, step, 0, tmp_path / "local", files, job_id=job_id)
            commit_checkpoint(storage, step, 1, meta_for(step, job="recon").model_copy(
                update={"job_id": job_id}), timeout=10)
        d.kill()  # the daemon misses the commits: its index says `saved` for S, nothing for T
        time.sleep(2)  # and the steps trained meanwhile (one each 0.5 s)
        restarted_at = time.time()
        d.start()
        rows = wait("S committed after the restart", lambda: (c := checkpoints(d, "recon"))
                    and c.get(s_step, {}).get("phase") == "committed" and c)
        # the history reads in order: the steps trained while the daemon was down, then what
        # the restarted daemon found in the store
        history = d.events("recon")
        reconciled = min(e["seq"] for e in history if e["cause"] == "reconciled")
        missed = [e["seq"] for e in history if e["kind"] == "step" and
                  e["time"] < restarted_at and e["seq"] > reconciled]
        assert not missed, (missed, reconciled)
        assert rows[t_step]["phase"] == "committed"
        assert "complete MANIFEST" in rows[t_step]["detail"]
        events = [e for e in d.event_details("recon") if e["kind"] == "checkpoint"
                  and e["cause"] == "reconciled"]
        assert {e["step"] for e in events} == {s_step, t_step}
        assert "said saved" in next(e for e in events if e["step"] == s_step)["message"]

        d.kill()  # T loses a shard behind the job's back while the daemon is down
        victim = next(o.key for o in storage.list(layout.files_prefix(t_step)))
        storage.delete([victim])
        d.start()
        rows = wait("T corrupt after the restart", lambda: (c := checkpoints(d, "recon"))
                    and c[t_step]["phase"] == "corrupt" and c)
        assert "missing in the store" in rows[t_step]["detail"]
        assert metric(d, "ds3d_checkpoint_problems_total", job="recon", problem="corrupt") == 1

        flip_a_byte(storage, next(o.key for o in storage.list(layout.files_prefix(s_step))),
                    tmp_path / "flip")
        assert checkpoints(d, "recon")[s_step]["phase"] == "committed"  # sizes cannot tell
        r = d.ctl("checkpoints", "recon", "--verify", timeout_s=120)
        assert r.returncode == 0, r.stderr
        assert f"step {s_step}: committed -> corrupt" in r.stdout and "sha256" in r.stdout
        rows = checkpoints(d, "recon")
        assert rows[s_step]["phase"] == "corrupt" and "sha256" in rows[s_step]["detail"]
        assert metric(d, "ds3d_checkpoint_problems_total", job="recon", problem="corrupt") == 2
        r = d.ctl("checkpoints", "recon", "--verify", timeout_s=120)
        assert "the index was right" in r.stdout  # nothing left to correct
    finally:
        d.stop()
        kill_job_processes(d.state_dir)


@pytest.mark.rgw  # moto answers every upload's Initiated with one fixed date in 2010
@pytest.mark.timeout(180)
def test_stale_multipart_uploads_and_uncommitted_steps_are_swept(
        rgw_server, rgw_bucket, tmp_path: Path) -> None:
    """Item 5 on a real S3 server (Ceph RGW): unfinished multipart uploads and uncommitted
    steps older than the grace period go; younger ones and committed steps stay."""
    server, bucket = rgw_server, rgw_bucket
    storage = server.storage(bucket, "jobs/sweep")
    local = tmp_path / "local"
    for step in (2, 4):
        files = write_fake_checkpoint(local, step)[0]
        upload_rank_files(storage, step, 0, local, files)
    commit_checkpoint(storage, 4, 1, meta_for(4), timeout=10)
    client = server.client()
    key = f"jobs/sweep/{layout.file_key(2, 'global_step2/big.pt')}"
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)

    catalog = Catalog(storage, None)
    young = catalog.sweep(grace_s=3600)
    assert (young.steps, young.uploads) == ([], [])  # everything is younger than an hour
    later = catalog.sweep(grace_s=3600, now=time.time() + 7200)  # two hours on
    assert later.steps == [2] and later.uploads == [layout.file_key(2, "global_step2/big.pt")]
    assert not later.failed
    left = client.list_multipart_uploads(Bucket=bucket, Prefix="jobs/sweep/").get("Uploads", [])
    assert left == []
    assert [o.key for o in storage.list(layout.step_prefix(2))] == []
    assert catalog.verify(4) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_real_job_tells_skips_failed_cleanups_and_leftovers(tmp_path: Path) -> None:
    """Items 3, 5 and 6 with the real trainer and a file store. Planted before the start: a
    part of another job inside step 2 (so retention can never delete step 2: a failed cleanup,
    every commit) and the leftovers of an interrupted save two hours ago (an uncommitted step 1
    and a `.tmp-ds3d-` file). Then the newest checkpoint is corrupted (same size) in the store
    and the local tier, and the job resumed: the restore skips it."""
    store_dir = tmp_path / "store"
    prefix = store_dir / "truth"
    (prefix / "ckpt" / "step-00000002" / "parts").mkdir(parents=True)
    (prefix / "ckpt" / "step-00000002" / "parts" / "rank-00007.json").write_bytes(
        PartManifest(step=2, rank=7, job_id="f" * 32, created=time.time(),
                     files=[]).model_dump_json().encode())
    leftovers = prefix / "ckpt" / "step-00000001" / "files" / "global_step1"
    leftovers.mkdir(parents=True)
    (leftovers / "mp_rank_00_model_states.pt").write_bytes(b"half" * 100)
    (leftovers / ".tmp-ds3d-0badc0de").write_bytes(b"torn")
    old = time.time() - 7200
    for f in leftovers.iterdir():
        os.utime(f, (old, old))

    d = DaemonProc(tmp_path / "state", args=["--hang-timeout", "300", "--metrics-port",
                                             str(free_port())])
    try:
        d.start()
        start(d, "truth", train={"steps": 10**6}, parallel={"tp": 1, "pp": 1, "dp": 1},
              checkpoint={"store": f"file://{store_dir}", "interval": 2, "keep_last": 1})

        def four_commits() -> dict[int, dict[str, Any]] | None:
            job = d.job("truth")
            assert job["state"] in ("PENDING", "STARTING", "RUNNING"), (
                job, d.ctl("logs", "truth", "--lines", "40").stdout)
            c = checkpoints(d, "truth")  # retention leaves 2 (undeletable) and the newest
            done = [r for r in c.values() if r["phase"] in ("committed", "deleted")]
            return c if len(done) >= 4 else None

        rows = wait("4 commits", four_commits, timeout_s=400)
        assert d.ctl("pause", "truth").returncode == 0
        d.wait_state("truth", "PAUSED", timeout_s=300)
        events = d.event_details("truth")

        # item 6: the failed cleanup is an event of its own; no checkpoint changed its state
        failed = [e for e in events if e["kind"] == "checkpoint"
                  and e["detail"].get("phase") == "cleanup_failed"]
        assert failed and {e["step"] for e in failed} == {2} and failed[0]["cause"] == "retention"
        assert "no checkpoint's state changed" in failed[0]["message"]
        assert "not deleted" in failed[0]["message"]
        rows = checkpoints(d, "truth")
        assert rows[2]["phase"] == "committed" and (prefix / layout.manifest_key(2)).is_file()
        assert not [s for s, r in rows.items() if r["phase"] == "failed"]
        assert metric(d, "ds3d_checkpoint_problems_total", job="truth",
                      problem="cleanup_failed") == len(failed)
        # item 5: the leftovers older than the grace period (1 h) are gone
        assert not (prefix / "ckpt" / "step-00000001").exists()
        assert any(e["detail"].get("phase") == "swept" for e in events)

        # item 3: the newest checkpoint, corrupted everywhere, is skipped by the restore
        stored = Catalog(open_storage(f"file://{prefix}"), None).list()  # the pause's save may
        newest = max(c.step for c in stored if c.state.value == "committed")  # be newer than rows
        manifest = json.loads((prefix / layout.manifest_key(newest)).read_text())
        shard = max(manifest["files"], key=lambda f: f["size"])["path"]
        # the file store hard-links the local tier's file: the stored object gets new bytes
        # under a new inode, and the local copy goes, so the restore must read the store
        stored_file = prefix / layout.file_key(newest, shard)
        data = bytearray(stored_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        (tmp_path / "flipped").write_bytes(bytes(data))
        os.replace(tmp_path / "flipped", stored_file)
        (d.state_dir / "jobs" / "truth" / "ckpt" / shard).unlink()
        # the resumed group hangs at its first step (a drill's hang, written where ds3dd writes
        # it): it restores, skipping the corrupted step, and trains no further, so no newer
        # commit lets retention (keep_last 1) delete the skipped step before it is listed
        (d.state_dir / "jobs" / "truth" / "control" / "inject.json").write_text(
            json.dumps({"id": 1, "kind": "hang", "rank": 0, "at_step": 1}))
        assert d.ctl("resume", "truth").returncode == 0
        skipped = wait("the skip event", lambda: [
            e for e in d.event_details("truth") if e["kind"] == "checkpoint"
            and e["detail"].get("phase") == "skipped"], timeout_s=300)
        rows = checkpoints(d, "truth")  # the job re-trains from an older step meanwhile: its
        assert d.ctl("stop", "truth", "--now").returncode == 0  # re-save of it cannot hide this
        assert skipped[0]["step"] == newest and skipped[0]["cause"] == "corrupt"
        assert "skipped by the restore (corrupt)" in skipped[0]["message"]
        assert rows[newest]["phase"] == "skipped" and shard in rows[newest]["detail"]
        assert metric(d, "ds3d_checkpoint_problems_total", job="truth", problem="skipped") >= 1
        loaded = wait("the restore", lambda: [
            e for e in d.event_details("truth") if e["kind"] == "checkpoint"
            and e["detail"].get("phase") == "loaded"], timeout_s=120)
        assert loaded[-1]["step"] < newest  # resumed from an older, intact checkpoint
        text = d.ctl("checkpoints", "truth").stdout
        assert f"step {newest:<8} skipped" in text
    finally:
        d.stop()
        kill_job_processes(d.state_dir)
