"""The must-show drill: real training (torchrun, TP 2 on gloo) checkpointing into Ceph RGW while
radosgw is `kill -9`-ed in the middle of a checkpoint's multipart upload.

1. Gateway back after a few seconds: the upload resumes (only missing parts sent, as the
   gateway's own access log shows), the checkpoint is committed exactly once (one MANIFEST PUT
   reached the server), training never waited for it (step times during the outage stay near
   the median before it), and the losses equal an uninterrupted run's.
2. Gateway down past the retry budget: the checkpoint stays local and uncommitted while
   training goes on; when the job runs again (the gateway back), the pending upload resumes and
   commits.

The model is the tiny preset widened to d_model 256, so each rank's ZeRO optimizer shard is
~19 MiB: four 5 MiB parts, paced to a few MiB/s so the upload lasts seconds (the kill window)."""

from __future__ import annotations

import json
import shutil
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog, CkptState
from ds3d.checkpoints.upload import read_marker

from support import losses, records, torchrun

pytest_plugins = ["fixtures.s3", "fixtures.rgw"]
pytestmark = [pytest.mark.rgw, pytest.mark.slow, pytest.mark.timeout(600)]

SETS = ["train.steps=30", "parallel.tp=2", "model.d_model=256", "checkpoint.interval=10",
        "checkpoint.keep_last=5"]
STEP = 10  # the checkpoint whose upload the outage hits
JOB = "jobs/tiny"  # store prefix + the job's name
TRANSFER = {"DS3D_S3_MULTIPART_THRESHOLD_MIB": "5", "DS3D_S3_MULTIPART_CHUNKSIZE_MIB": "5",
            "DS3D_S3_MAX_CONCURRENCY": "2"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Losses of the same job with a file store and no outage."""
    run = tmp_path_factory.mktemp("reference") / "run"
    torchrun(run, 2, sets=SETS)
    return losses(run)


class Background:
    """Runs `fn` in a thread; `join` re-raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # re-raised by join() in the test's thread
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"still running after {timeout} s"
        if self.error is not None:
            raise self.error


def wait_for_part_in_flight(client: Any, bucket: str, step: int, training: Background,
                            timeout: float = 120) -> str:
    """Polls the gateway until a multipart upload of `step` has some, not all, parts stored;
    returns its key."""
    prefix = f"{JOB}/{layout.files_prefix(step)}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert training.alive(), "training ended before the upload could be interrupted"
        for up in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []):
            parts = client.list_parts(Bucket=bucket, Key=up["Key"],
                                      UploadId=up["UploadId"]).get("Parts", [])
            if parts:
                return str(up["Key"])
        time.sleep(0.05)
    raise TimeoutError(f"no multipart upload of step {step} in flight after {timeout} s")


def worker_events(run: Path, event: str) -> list[dict[str, Any]]:
    """The workers' structlog events (JSON lines in torchrun.log)."""
    out = []
    for line in (run / "torchrun.log").read_text().splitlines():
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("event") == event:
                out.append(rec)
    return out


def assert_no_stall(run: Path, t_down: float, t_up: float) -> None:
    """Steps finished during the outage took, and were spaced, at most 3x the median before it
    (+0.5 s for a loaded 2-core machine)."""
    steps = records(run, 0, "step")
    before = [r for r in steps if r["time"] < t_down and r["step"] > 1]
    during = [r for r in steps if t_down <= r["time"] <= t_up]
    assert len(before) >= 5 and len(during) >= 3, (len(before), len(during))
    step_median = statistics.median(r["step_time_s"] for r in before)
    worst = max(r["step_time_s"] for r in during)
    assert worst < 3 * step_median + 0.5, (worst, step_median)
    times = {r["step"]: r["time"] for r in steps}
    gap_median = statistics.median(times[r["step"]] - times[r["step"] - 1] for r in before
                                   if r["step"] - 1 in times)
    gaps = [times[r["step"]] - times[r["step"] - 1] for r in during]
    assert max(gaps) < 3 * gap_median + 0.5, (max(gaps), gap_median)


def manifest_puts(rgw_cluster: Any, bucket: str, step: int, want: int) -> list[Any]:
    """PUTs of the step's MANIFEST that reached the gateway (its access log is written
    asynchronously: wait for `want`, then a moment more for any extra one)."""
    path = f"/{bucket}/{JOB}/{layout.manifest_key(step)}"
    deadline = time.monotonic() + 10
    while True:
        puts = [r for r in rgw_cluster.requests(bucket, "PUT") if r.path == path]
        if len(puts) >= want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    return [r for r in rgw_cluster.requests(bucket, "PUT") if r.path == path]


def train_through_outage(rgw_cluster: Any, rgw_server: Any, bucket: str, run: Path,
                         env: dict[str, str]) -> tuple[str, float, float]:
    """Trains the job against the gateway, which is killed -9 for 3 s while step STEP's upload
    has a part in flight; returns (the key being uploaded, time down, time up)."""
    store = f'checkpoint.store="s3://{bucket}/jobs"'
    training = Background(lambda: torchrun(run, 2, sets=SETS + [store], env=env, timeout=400))
    key = wait_for_part_in_flight(rgw_server.client(), bucket, STEP, training)
    with rgw_cluster.gateway_down():
        t_down = time.time()
        time.sleep(3.0)
    t_up = time.time()
    training.join(420)
    return key, t_down, t_up


def test_gateway_killed_mid_upload_training_rides_it_out(
        rgw_cluster: Any, rgw_server: Any, rgw_bucket: str, tmp_path: Path,
        reference: dict[int, float]) -> None:
    run = tmp_path / "run"
    # Two attempts per request: botocore alone would otherwise wait out a short outage inside
    # one part's request, and the whole-upload retry (which resumes) would not be needed.
    env = {**rgw_server.env(), **TRANSFER, "DS3D_S3_MAX_BANDWIDTH_MIB": "4",
           "DS3D_S3_MAX_ATTEMPTS": "2", "DS3D_S3_OUTAGE_RETRIES": "8"}
    key, t_down, t_up = train_through_outage(rgw_cluster, rgw_server, rgw_bucket, run, env)
    client = rgw_server.client()

    # The outage hit the upload, which resumed instead of starting over.
    retries = [e for e in worker_events(run, "storage_retry")
               if f"step-{STEP:08d}" in str(e.get("key"))]
    assert retries, "no upload of the checkpoint met the outage"
    resumed = [e for e in worker_events(run, "multipart_resumed") if e["key"] == key]
    assert resumed and resumed[0]["kept"] >= 1 and resumed[0]["sending"] < resumed[0]["parts"]
    part_puts = Counter(r.query["partNumber"] for r in rgw_cluster.requests(rgw_bucket, "PUT")
                        if r.path == f"/{rgw_bucket}/{key}" and r.status == 200
                        and "partNumber" in r.query)
    assert part_puts and max(part_puts.values()) == 1, part_puts  # no stored part sent twice

    # Committed exactly once: one MANIFEST object, one PUT of it at the server, one commit.
    puts = manifest_puts(rgw_cluster, rgw_bucket, STEP, want=1)
    assert [r.status for r in puts] == [200]
    listed = client.list_objects_v2(Bucket=rgw_bucket,
                                    Prefix=f"{JOB}/{layout.step_prefix(STEP)}M")["Contents"]
    assert [o["Key"] for o in listed] == [f"{JOB}/{layout.manifest_key(STEP)}"]
    commits = [e for e in worker_events(run, "checkpoint_committed") if e["step"] == STEP]
    assert [e["written"] for e in commits] == [True]
    phases = [(r["step"], r["phase"]) for r in records(run, 0, "checkpoint")]
    assert phases.count((STEP, "committed")) == 1 and (STEP, "failed") not in phases

    storage = rgw_server.storage(rgw_bucket, JOB)
    assert storage.list_incomplete_uploads() == []
    assert Catalog(storage, tmp_path / "fresh").verify(STEP, checksums=True) == []
    assert [c.step for c in Catalog(storage, None).list()
            if c.state is CkptState.COMMITTED] == [10, 20, 30]

    assert_no_stall(run, t_down, t_up + 2)
    got = losses(run)
    assert sorted(got) == list(range(1, 31))
    for step in got:
        assert got[step] == pytest.approx(reference[step], rel=1e-6, abs=0), step


def test_gateway_down_past_retry_budget_then_committed_by_the_next_run(
        rgw_cluster: Any, rgw_server: Any, rgw_bucket: str, tmp_path: Path,
        reference: dict[int, float]) -> None:
    run = tmp_path / "run"
    # A budget of about a second (one request attempt, one whole-upload retry): a 3 s outage
    # outlasts it. The Uploader's own retry comes DS3D_UPLOAD_RETRY_S later (here 2 s, default
    # 30): the job's end waits for the store (wait_for_store) and that retry commits the step in
    # this run; a run that ends first leaves it to the next run (below).
    env = {**rgw_server.env(), **TRANSFER, "DS3D_S3_MAX_BANDWIDTH_MIB": "8",
           "DS3D_S3_MAX_ATTEMPTS": "1", "DS3D_S3_OUTAGE_RETRIES": "1",
           "DS3D_UPLOAD_RETRY_S": "2"}
    key, t_down, t_up = train_through_outage(rgw_cluster, rgw_server, rgw_bucket, run, env)
    shutil.copy(run / "torchrun.log", run / "torchrun-first.log")

    # Training went on; the checkpoint is kept locally, marked failed, and not committed.
    assert_no_stall(run, t_down, t_up + 2)
    got = losses(run)
    for step in range(1, 31):
        assert got[step] == pytest.approx(reference[step], rel=1e-6, abs=0), step
    local = run / "ckpt"
    states = [read_marker(layout.local_rank_marker(local, STEP, r))["state"] for r in (0, 1)]
    storage = rgw_server.storage(rgw_bucket, JOB)
    if "committed" in states:
        # the job waits at its end until its last checkpoint is durable (wait_for_store); that
        # wait can outlast the uploader's own retry interval, which then resumed and committed
        # the failed step in this same run: it must be whole, and committed exactly once
        assert states == ["committed", "uploaded"], states
        phases = [(r["step"], r["phase"]) for r in records(run, 0, "checkpoint")]
        assert (STEP, "failed") in phases and phases.count((STEP, "committed")) == 1, phases
        assert Catalog(storage, tmp_path / "fresh").verify(STEP, checksums=True) == []
        assert storage.list_incomplete_uploads() == []
        return
    assert "failed" in states and "committed" not in states, states
    assert (local / f"global_step{STEP}").is_dir()
    assert not storage.exists(layout.manifest_key(STEP))
    info = {c.step: c for c in Catalog(storage, local).list()}
    assert info[STEP].state is not CkptState.COMMITTED and info[STEP].in_local
    phases = [(r["step"], r["phase"]) for r in records(run, 0, "checkpoint")]
    assert (STEP, "failed") in phases and (STEP, "committed") not in phases

    # The job runs again with the gateway back: it restores step 30 and has nothing left to
    # train, but first finishes the pending upload, resumed from where it stopped.
    seen = len(records(run, 0, "checkpoint"))
    store = f'checkpoint.store="s3://{rgw_bucket}/jobs"'
    torchrun(run, 2, sets=SETS + [store], env={**rgw_server.env(), **TRANSFER}, timeout=300)
    again = [(r["step"], r["phase"]) for r in records(run, 0, "checkpoint")[seen:]]
    assert (30, "loaded") in again and again.count((STEP, "committed")) == 1, again
    resumed = {e["key"]: e for e in worker_events(run, "multipart_resumed")
               if f"step-{STEP:08d}" in e["key"]}
    # the upload that had parts stored when the gateway died kept them (another file's upload
    # may have been created with none stored yet: it keeps 0); each sends only what is missing
    assert key in resumed and resumed[key]["kept"] >= 1, ("the failed upload started over", key,
                                                          resumed)
    assert all(e["kept"] + e["sending"] == e["parts"] for e in resumed.values()), resumed
    assert [r.status for r in manifest_puts(rgw_cluster, rgw_bucket, STEP, want=1)] == [200]
    assert Catalog(storage, tmp_path / "fresh").verify(STEP, checksums=True) == []
    assert storage.list_incomplete_uploads() == []
    assert [read_marker(layout.local_rank_marker(local, STEP, r))["state"]
            for r in (0, 1)] == ["committed", "uploaded"]
