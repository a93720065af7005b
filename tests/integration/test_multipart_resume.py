"""Multipart uploads resume: a retry after an outage, or the next process after a crash, sends
only the parts the server does not have, and never leaves an unfinished upload behind. On
moto_server and on Ceph RGW (a real `kill -9` of the gateway there). Every test counts the
UploadPart calls that reached the server, so a retry that started over would fail it."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
from botocore.exceptions import ClientError, EndpointConnectionError

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog, CkptState
from ds3d.checkpoints.s3_storage import S3Storage, UploadJournal
from ds3d.checkpoints.storage import open_storage
from ds3d.checkpoints.upload import Uploader, multipart_journal_path, read_marker, upload_rank_files
from ds3d.trainer.errors import ConfigError, TransientStorageError

from fixtures.ckpt import meta_for, write_fake_checkpoint

pytest_plugins = ["fixtures.s3", "fixtures.rgw"]
pytestmark = pytest.mark.timeout(180)

PART = 5 << 20
SIZE = 4 * PART + (1 << 20)  # 5 parts, the last one short
PARTS = 5
KEY = "ckpt/step-00000007/files/global_step7/zero_pp_rank_0_mp_rank_00_optim_states.pt"
# Patient enough to ride out a short outage, quick enough for tests.
RIDE_OUT = {"max_attempts": 2, "outage_retries": 8, "backoff_base": 0.2, "backoff_max": 1.0,
            "max_concurrency": 2}
# One part at a time, so that exactly parts 1 and 2 are stored when the outage begins.
GIVE_UP = {"max_attempts": 1, "outage_retries": 0, "max_concurrency": 1}


@pytest.fixture(params=["moto", pytest.param("rgw", marks=pytest.mark.rgw)])
def tier(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_storage(tier: str, request: pytest.FixtureRequest) -> Callable[..., S3Storage]:
    """New S3Storage objects on one bucket: a second one is what a restarted process has."""
    make = request.getfixturevalue("make_s3_storage" if tier == "moto" else "make_rgw_storage")
    return lambda **options: make("jobs/mp", **options)


class PartCounter:
    """Counts this storage's UploadPart calls (the counting wrapper around the client's
    upload_part), and can take the endpoint down: while `down`, every request fails as a
    refused connection would (botocore's before-send hook), exactly as an outage looks."""

    def __init__(self, storage: S3Storage, down_after: int | None = None,
                 down_for: float = 0.0) -> None:
        self.sent: list[int] = []
        self.failed: list[int] = []
        self.down = False
        self._down_after, self._down_for = down_after, down_for
        self._lock = threading.Lock()
        inner = storage.client.upload_part

        def upload_part(**kw: Any) -> Any:
            try:
                resp = inner(**kw)
            except Exception:
                with self._lock:
                    self.failed.append(kw["PartNumber"])
                raise
            with self._lock:
                self.sent.append(kw["PartNumber"])
                if self._down_after is not None and len(self.sent) == self._down_after:
                    self.start_outage()
            return resp

        storage.client.upload_part = upload_part
        endpoint = storage.endpoint

        def refuse(**_: Any) -> None:
            if self.down:
                raise EndpointConnectionError(endpoint_url=endpoint)

        storage.client.meta.events.register("before-send.s3", refuse)

    def start_outage(self) -> None:
        self.down = True
        if self._down_for:
            threading.Timer(self._down_for, self.end_outage).start()

    def end_outage(self) -> None:
        self.down = False


def big_file(path: Path, size: int = SIZE) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def assert_no_unfinished(storage: S3Storage) -> None:
    assert storage.list_incomplete_uploads() == []


def fail_midway(storage: S3Storage, src: Path, journal: Path | None) -> PartCounter:
    """An upload that stops for good after two parts (gateway down past the retry budget)."""
    counter = PartCounter(storage, down_after=2)
    with pytest.raises(TransientStorageError, match="cannot reach"):
        if journal is None:
            storage.put_file(src, KEY)
        else:
            with storage.upload_journal(journal):
                storage.put_file(src, KEY)
    assert sorted(counter.sent) == [1, 2] and counter.failed
    return counter


def resume(restarted: S3Storage, src: Path, journal: Path) -> tuple[list[int], list[dict]]:
    """The next process's upload of `src` with the journal: (part numbers it sent, its log)."""
    counter = PartCounter(restarted)
    with structlog.testing.capture_logs() as logs, restarted.upload_journal(journal):
        restarted.put_file(src, KEY)
    return counter.sent, logs


def test_retry_after_outage_sends_only_missing_parts(make_storage: Any, tmp_path: Path) -> None:
    storage = make_storage(**RIDE_OUT)
    data = big_file(tmp_path / "shard.pt")
    counter = PartCounter(storage, down_after=2, down_for=0.6)
    with structlog.testing.capture_logs() as logs:
        storage.put_file(tmp_path / "shard.pt", KEY)
    assert any(e["event"] == "storage_retry" for e in logs)  # the outage was hit
    assert counter.failed  # ... by part uploads
    # Each part reached the server exactly once: none sent before the outage was sent again.
    assert Counter(counter.sent) == Counter(range(1, PARTS + 1))
    (resumed,) = [e for e in logs if e["event"] == "multipart_resumed"]
    assert resumed["kept"] >= 2 and resumed["kept"] + resumed["sending"] == PARTS
    assert storage.get_bytes(KEY) == data
    assert_no_unfinished(storage)


def test_next_process_resumes_from_the_journal(make_storage: Any, tmp_path: Path) -> None:
    src, journal = tmp_path / "shard.pt", tmp_path / ".ds3d" / "multipart-rank-00000.json"
    data = big_file(src)
    first = fail_midway(make_storage(**GIVE_UP), src, journal)
    (rec,) = UploadJournal(journal).records().values()  # survives the process

    restarted = make_storage(**RIDE_OUT)  # a new process: new client, nothing in memory
    sent, logs = resume(restarted, src, journal)
    assert sorted(sent) == [3, 4, 5]
    assert Counter(first.sent + sent) == Counter(range(1, PARTS + 1))
    assert [(e["upload_id"], e["kept"]) for e in logs if e["event"] == "multipart_resumed"] == [
        (rec["upload_id"], 2)]
    assert restarted.get_bytes(KEY) == data
    assert not journal.exists()  # nothing left unfinished
    assert_no_unfinished(restarted)


def test_same_process_retry_resumes_without_a_journal_file(make_storage: Any,
                                                          tmp_path: Path) -> None:
    """The Uploader's later retry in the same process (after the budget ran out) resumes too."""
    storage = make_storage(**GIVE_UP)
    data = big_file(tmp_path / "shard.pt")
    counter = fail_midway(storage, tmp_path / "shard.pt", None)
    counter.end_outage()
    storage.put_file(tmp_path / "shard.pt", KEY)
    assert Counter(counter.sent) == Counter(range(1, PARTS + 1))
    assert storage.get_bytes(KEY) == data
    assert_no_unfinished(storage)


def test_upload_unknown_to_the_server_starts_over(make_storage: Any, tmp_path: Path) -> None:
    src, journal = tmp_path / "shard.pt", tmp_path / "journal.json"
    data = big_file(src)
    fail_midway(make_storage(**GIVE_UP), src, journal)
    (rec,) = UploadJournal(journal).records().values()
    restarted = make_storage(**RIDE_OUT)
    restarted.client.abort_multipart_upload(  # e.g. a lifecycle rule expired it
        Bucket=restarted.bucket, Key=restarted.prefix + KEY, UploadId=rec["upload_id"])
    sent, logs = resume(restarted, src, journal)
    assert [e["upload_id"] for e in logs if e["event"] == "multipart_restarted"] == [
        rec["upload_id"]]
    assert sorted(sent) == list(range(1, PARTS + 1))
    assert restarted.get_bytes(KEY) == data
    assert not journal.exists()
    assert_no_unfinished(restarted)


def test_changed_local_file_aborts_the_old_upload(make_storage: Any, tmp_path: Path) -> None:
    src, journal = tmp_path / "shard.pt", tmp_path / "journal.json"
    big_file(src)
    fail_midway(make_storage(**GIVE_UP), src, journal)
    (rec,) = UploadJournal(journal).records().values()
    data = big_file(src, SIZE + 1000)  # saved again: other bytes, other size
    restarted = make_storage(**RIDE_OUT)
    sent, logs = resume(restarted, src, journal)
    assert [e["upload_id"] for e in logs if e["event"] == "multipart_aborted"] == [
        rec["upload_id"]]
    assert sorted(sent) == list(range(1, PARTS + 1))
    assert restarted.get_bytes(KEY) == data
    assert_no_unfinished(restarted)


def test_parts_not_listable_starts_over(make_s3_storage: Any, aws_env: None,
                                        tmp_path: Path) -> None:
    """Credentials without s3:ListMultipartUploadParts: resuming is impossible, not fatal."""
    src, journal = tmp_path / "shard.pt", tmp_path / "journal.json"
    data = big_file(src)
    fail_midway(make_s3_storage("jobs/mp", **GIVE_UP), src, journal)
    restarted = make_s3_storage("jobs/mp", **RIDE_OUT)
    paginator = restarted.client.get_paginator

    def deny_list_parts(name: str) -> Any:
        if name == "list_parts":
            raise ClientError({"Error": {"Code": "AccessDenied", "Message": "denied"},
                               "ResponseMetadata": {"HTTPStatusCode": 403}}, "ListParts")
        return paginator(name)

    restarted.client.get_paginator = deny_list_parts
    sent, logs = resume(restarted, src, journal)
    assert [e["event"] for e in logs if e["event"].startswith("multipart_")] == [
        "multipart_aborted", "multipart_restarted"]
    assert sorted(sent) == list(range(1, PARTS + 1))
    assert restarted.get_bytes(KEY) == data
    assert restarted.list_incomplete_uploads() == []


def test_stored_part_with_other_bytes_is_sent_again(make_storage: Any, tmp_path: Path) -> None:
    """Kept parts are checked against the local bytes (size and MD5 ETag), not trusted."""
    src, journal = tmp_path / "shard.pt", tmp_path / "journal.json"
    data = big_file(src)
    fail_midway(make_storage(**GIVE_UP), src, journal)
    (rec,) = UploadJournal(journal).records().values()
    restarted = make_storage(**RIDE_OUT)
    restarted.client.upload_part(Bucket=restarted.bucket, Key=restarted.prefix + KEY,
                                 UploadId=rec["upload_id"], PartNumber=2,
                                 Body=os.urandom(PART))  # same size, other bytes
    sent, _ = resume(restarted, src, journal)
    assert sorted(sent) == [2, 3, 4, 5]
    assert restarted.get_bytes(KEY) == data


def test_lost_completion_answer_sends_nothing_again(make_storage: Any, tmp_path: Path) -> None:
    """CompleteMultipartUpload went through but its answer was lost: the retry finds the
    upload gone, sees that the object already holds the file, and is done."""
    storage = make_storage(**RIDE_OUT)
    data = big_file(tmp_path / "shard.pt")
    counter = PartCounter(storage)
    lost: list[int] = []

    def lose_answer(**_: Any) -> None:
        if not lost:
            lost.append(1)
            raise EndpointConnectionError(endpoint_url=storage.endpoint)

    storage.client.meta.events.register("after-call.s3.CompleteMultipartUpload", lose_answer)
    with structlog.testing.capture_logs() as logs:
        storage.put_file(tmp_path / "shard.pt", KEY)
    assert lost and any(e["event"] == "multipart_already_complete" for e in logs)
    assert sorted(counter.sent) == list(range(1, PARTS + 1))  # each part once
    assert storage.get_bytes(KEY) == data
    assert_no_unfinished(storage)


def test_leftover_upload_of_the_key_is_aborted(make_storage: Any, tmp_path: Path) -> None:
    """An upload begun by a process killed before it could journal it costs storage until
    aborted: the next completed upload of that key aborts it."""
    storage = make_storage(**RIDE_OUT)
    stray = storage.client.create_multipart_upload(Bucket=storage.bucket,
                                                   Key=storage.prefix + KEY)["UploadId"]
    storage.client.upload_part(Bucket=storage.bucket, Key=storage.prefix + KEY, UploadId=stray,
                               PartNumber=1, Body=os.urandom(PART))
    other = "ckpt/step-00000007/files/global_step7/other.pt"
    kept = storage.client.create_multipart_upload(Bucket=storage.bucket,
                                                  Key=storage.prefix + other)["UploadId"]
    data = big_file(tmp_path / "shard.pt")
    storage.put_file(tmp_path / "shard.pt", KEY)
    assert storage.get_bytes(KEY) == data
    assert storage.list_incomplete_uploads() == [(other, kept)]  # other keys are not touched


def test_abandoned_checkpoint_aborts_its_uploads(make_storage: Any, tmp_path: Path) -> None:
    """The Uploader: a checkpoint whose upload failed midway and whose local files then
    vanished is abandoned, and its journaled multipart upload is aborted."""
    storage = make_storage(**GIVE_UP)
    big = "global_step7/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    files = write_fake_checkpoint(tmp_path, 7, big={big: SIZE})
    counter = PartCounter(storage, down_after=2)
    up = Uploader(storage, tmp_path, rank=0, world_size=1, retry_interval=60)
    up.submit(7, files[0], meta_for(7))
    assert up.wait(60)
    assert up.failed() == [7] and sorted(counter.sent) == [1, 2]
    journal = multipart_journal_path(tmp_path, 7, 0)
    counter.end_outage()
    assert journal.exists() and len(storage.list_incomplete_uploads()) == 1
    (tmp_path / big).unlink()
    up.retry_failed_now()
    deadline = time.monotonic() + 20
    while up.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    up.close()
    assert up.pending() == []
    assert_no_unfinished(storage)
    assert not journal.exists()
    assert "local files unreadable" in read_marker(layout.local_rank_marker(tmp_path, 7, 0))[
        "error"]


def test_deleted_checkpoint_aborts_its_unfinished_uploads(make_storage: Any,
                                                         tmp_path: Path) -> None:
    """`Catalog.delete` (retention, rollback, `ds3dctl`) also aborts the step's multipart
    uploads a killed uploader left behind, and only that step's."""
    storage = make_storage(**GIVE_UP)
    files = write_fake_checkpoint(tmp_path, 7)
    upload_rank_files(storage, 7, 0, tmp_path, files[0])
    left = {}
    for step in (7, 8):
        key = layout.file_key(step, "global_step/zero_pp_rank_0_mp_rank_00_optim_states.pt")
        left[step] = storage.client.create_multipart_upload(
            Bucket=storage.bucket, Key=storage.prefix + key)["UploadId"]
    Catalog(storage, None).delete(7)
    assert [u for _, u in storage.list_incomplete_uploads()] == [left[8]]
    assert storage.list(layout.step_prefix(7)) == []


def test_transfer_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                 aws_env: None) -> None:
    """How a job's workers (which open the store by URL) get transfer and retry settings."""
    monkeypatch.setenv("DS3D_S3_MULTIPART_CHUNKSIZE_MIB", "8")
    monkeypatch.setenv("DS3D_S3_MAX_BANDWIDTH_MIB", "2.5")
    monkeypatch.setenv("DS3D_S3_OUTAGE_RETRIES", "9")
    storage = open_storage("s3://bucket-x/p", endpoint_url="http://127.0.0.1:9", outage_retries=2)
    assert isinstance(storage, S3Storage)
    assert storage.transfer.multipart_chunksize == 8 << 20
    assert storage.transfer.max_bandwidth == int(2.5 * (1 << 20))
    assert storage.outage_retries == 2  # an explicit option wins
    monkeypatch.setenv("DS3D_S3_MULTIPART_CHUNKSIZE_MIB", "1")  # below S3's 5 MiB part minimum
    with pytest.raises(ConfigError, match="DS3D_S3_MULTIPART_CHUNKSIZE_MIB"):
        open_storage("s3://bucket-x/p")


def test_transfer_settings_from_the_job_config(monkeypatch: pytest.MonkeyPatch,
                                               aws_env: None, tmp_path: Path) -> None:
    """`[checkpoint.s3]` in the job config: what the workers' CheckpointManager opens the
    store with (open_job_storage); set fields win over the daemon's DS3D_S3_* environment,
    unset ones fall back. Nothing is sent: the endpoint is unreachable on purpose."""
    from ds3d.checkpoints.engine_io import open_job_storage
    from ds3d.trainer.config import build_job_config

    monkeypatch.setenv("DS3D_S3_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("DS3D_S3_MAX_CONCURRENCY", "3")
    monkeypatch.setenv("DS3D_S3_OUTAGE_RETRIES", "9")
    cfg = build_job_config("tiny", ['checkpoint.store="s3://bucket-x/runs"',
                                    "checkpoint.s3.multipart_chunksize_mib=16",
                                    "checkpoint.s3.max_bandwidth_mib=0",
                                    "checkpoint.s3.outage_retries=4"])
    storage = open_job_storage(cfg.checkpoint_settings(), tmp_path)
    assert isinstance(storage, S3Storage) and storage.prefix == "runs/tiny/"
    assert storage.transfer.multipart_chunksize == 16 << 20
    assert storage.transfer.max_bandwidth is None  # 0 = unlimited
    assert storage.outage_retries == 4  # the config wins over DS3D_S3_OUTAGE_RETRIES
    assert storage.transfer.max_concurrency == 3  # unset: from the environment
    with pytest.raises(ConfigError, match="multipart_chunksize_mib"):
        build_job_config("tiny", ["checkpoint.s3.multipart_chunksize_mib=1"])


@pytest.mark.rgw
def test_gateway_kill_mid_upload_resumes(rgw_cluster: Any, make_rgw_storage: Any,
                                         rgw_bucket: str, tmp_path: Path) -> None:
    """A real outage: radosgw is SIGKILLed while parts are in flight and restarted 1.5 s later.
    The server's own access log shows no part of the upload stored twice."""
    storage = make_rgw_storage("jobs/kill", **{**RIDE_OUT, "max_bandwidth": 8 << 20,
                                              "outage_retries": 30})
    data = big_file(tmp_path / "shard.pt", 8 * PART)  # 8 parts paced at 8 MiB/s: ~4 s
    counter = PartCounter(storage)
    errors: list[BaseException] = []

    def upload() -> None:
        try:
            storage.put_file(tmp_path / "shard.pt", KEY)
        except BaseException as e:  # re-raised in the test's thread below
            errors.append(e)

    with structlog.testing.capture_logs() as logs:
        thread = threading.Thread(target=upload)
        thread.start()
        deadline = time.monotonic() + 30
        while len(counter.sent) < 2:
            assert time.monotonic() < deadline and thread.is_alive(), errors
            time.sleep(0.01)
        with rgw_cluster.gateway_down():
            before = sorted(counter.sent)
            time.sleep(1.5)
        thread.join(60)
    assert not thread.is_alive() and not errors, errors
    assert any(e["event"] == "storage_retry" for e in logs)
    assert before and len(before) < 8  # killed midway
    assert Counter(counter.sent) == Counter(range(1, 9))  # nothing sent twice
    (resumed,) = [e for e in logs if e["event"] == "multipart_resumed"]
    assert resumed["kept"] >= len(before)
    assert storage.get_bytes(KEY) == data
    assert_no_unfinished(storage)
    deadline = time.monotonic() + 10
    while True:  # the gateway writes its log asynchronously
        stored = Counter(r.query["partNumber"] for r in rgw_cluster.requests(rgw_bucket, "PUT")
                         if r.status == 200 and "partNumber" in r.query)
        if sum(stored.values()) >= 8 - len(before) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stored and max(stored.values()) == 1, stored


def test_resumed_checkpoint_commits(make_storage: Any, tmp_path: Path) -> None:
    """Through the Uploader: gateway down past the retry budget, the checkpoint stays local and
    uncommitted; a new process resumes it from the journal and commits it."""
    storage = make_storage(**GIVE_UP)
    big = "global_step7/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    files = write_fake_checkpoint(tmp_path, 7, big={big: SIZE})
    first = PartCounter(storage, down_after=2)
    up = Uploader(storage, tmp_path, rank=0, world_size=1, retry_interval=60)
    up.submit(7, files[0], meta_for(7))
    assert up.wait(60)
    up.close()  # the process ends with the upload failed
    assert read_marker(layout.local_rank_marker(tmp_path, 7, 0))["state"] == "failed"
    assert (tmp_path / big).is_file()
    restarted = make_storage(**RIDE_OUT)
    assert [c.state for c in Catalog(restarted, tmp_path).list()] == [CkptState.UPLOADING]

    counter = PartCounter(restarted)
    up = Uploader(restarted, tmp_path, rank=0, world_size=1, commit_timeout=30)
    assert up.resume_pending() == [7]
    assert up.wait(60)
    up.close()
    assert Counter(first.sent + counter.sent) == Counter(range(1, PARTS + 1))
    assert [c.state for c in Catalog(restarted, tmp_path).list()] == [CkptState.COMMITTED]
    assert Catalog(restarted, tmp_path / "fresh").verify(7, checksums=True) == []
    assert_no_unfinished(restarted)
