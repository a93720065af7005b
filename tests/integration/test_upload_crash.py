"""Crash safety: an uploader SIGKILLed in the middle of a multipart upload never produces a
restorable checkpoint, the previous one stays the restore point, and the next upload resumes the
killed one (sending only the missing parts) and commits. Corrupt shards (truncated, bit-flipped)
are caught by size / sha256 and skipped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import structlog

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog, CkptState
from ds3d.checkpoints.s3_storage import S3Storage, UploadJournal
from ds3d.checkpoints.upload import (
    commit_checkpoint,
    multipart_journal_path,
    read_marker,
    upload_rank_files,
)

from fixtures.ckpt import meta_for, write_fake_checkpoint

pytest_plugins = ["fixtures.s3"]
pytestmark = pytest.mark.timeout(180)

BIG = "global_step200/zero_pp_rank_0_mp_rank_00_optim_states.pt"  # sorts last: uploaded last


def save_and_commit(storage: S3Storage, local: Path, step: int) -> None:
    files = write_fake_checkpoint(local, step, size=2048)
    upload_rank_files(storage, step, 0, local, files[0])
    commit_checkpoint(storage, step, 1, meta_for(step), timeout=10)


def upload_cmd(storage: S3Storage, local: Path, step: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ds3d.checkpoints.upload", "--store", storage.url,
            "--step", str(step), "--rank", "0", "--world-size", "1", "--dir", str(local),
            "--commit", "--commit-timeout", "10", "--threshold-mib", "5", "--chunk-mib", "5",
            "--concurrency", "1", *extra]


def wait_for_parts(storage: S3Storage, proc: subprocess.Popen[bytes], timeout: float) -> int:
    """Polls until a multipart upload of the big file has at least one part stored."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the upload ended before it could be killed"
        for key, upload_id in storage.list_incomplete_uploads():
            if key.endswith(BIG):
                parts = storage.client.list_parts(Bucket=storage.bucket,
                                                  Key=storage.prefix + key, UploadId=upload_id)
                if parts.get("Parts"):
                    return len(parts["Parts"])
        time.sleep(0.02)
    raise TimeoutError("no multipart part appeared")


def test_sigkill_mid_multipart_upload(make_s3_storage: Any, moto_server: Any,
                                      tmp_path: Path) -> None:
    storage = make_s3_storage("jobs/crash")
    local = tmp_path / "local"
    save_and_commit(storage, local, 100)
    write_fake_checkpoint(local, 200, size=2048, big={BIG: 40 << 20})

    env = {**os.environ, **moto_server.env()}
    # 8 MiB/s: the 40 MiB shard takes ~5 s, so the kill surely lands mid-upload.
    proc = subprocess.Popen(upload_cmd(storage, local, 200, "--max-bandwidth-mib", "8"), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        parts = wait_for_parts(storage, proc, timeout=60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert 1 <= parts < 8  # killed with the 40 MiB shard (8 parts) partly sent

    # The store: step 200 has some files but no parts manifest, no MANIFEST.
    assert not storage.exists(layout.manifest_key(200))
    assert not storage.list(layout.parts_prefix(200))
    assert storage.list(layout.files_prefix(200))
    assert not storage.exists(layout.file_key(200, BIG))
    assert storage.get_bytes(layout.LATEST_KEY) == b"ckpt/step-00000100"
    assert read_marker(layout.local_rank_marker(local, 200, 0))["state"] == "pending"
    (journaled,) = UploadJournal(multipart_journal_path(local, 200, 0)).records().values()
    assert [u for k, u in storage.list_incomplete_uploads() if k.endswith(BIG)] == [
        journaled["upload_id"]]

    states = {c.step: c.state for c in Catalog(storage, local).list()}
    assert states == {100: CkptState.COMMITTED, 200: CkptState.UPLOADING}
    for where in (local, tmp_path / "fresh-node"):
        found = Catalog(storage, where).newest_restorable()
        assert found is not None and found.step == 100

    # The next attempt continues the killed upload (its parts are kept, not sent again) and
    # commits step 200; no unfinished upload is left behind.
    done = subprocess.run(upload_cmd(storage, local, 200), env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    resumed = [e for e in events if e["event"] == "multipart_resumed"]
    assert [(e["upload_id"], e["parts"]) for e in resumed] == [(journaled["upload_id"], 8)]
    assert resumed[0]["kept"] >= parts and resumed[0]["sending"] == 8 - resumed[0]["kept"]
    assert storage.list_incomplete_uploads() == []
    assert not multipart_journal_path(local, 200, 0).exists()
    found = Catalog(storage, tmp_path / "fresh-node-2").newest_restorable()
    assert found is not None and (found.step, found.source) == (200, "downloaded")
    assert Catalog(storage, local).verify(200, checksums=True) == []
    assert read_marker(layout.local_rank_marker(local, 200, 0))["state"] == "committed"


def corrupt_object(storage: S3Storage, key: str, how: str) -> None:
    data = bytearray(storage.get_bytes(key))
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0x10
    storage.put_bytes(key, bytes(data))


@pytest.mark.parametrize("how", ["truncate", "bitflip"])
def test_corrupt_shard_in_store_falls_back(make_s3_storage: Any, tmp_path: Path,
                                           how: str) -> None:
    storage = make_s3_storage("jobs/corrupt")
    local = tmp_path / "local"
    for step in (100, 200):
        save_and_commit(storage, local, step)
    shard = "global_step200/mp_rank_00_model_states.pt"
    corrupt_object(storage, layout.file_key(200, shard), how)

    catalog = Catalog(storage, tmp_path / "fresh")
    with structlog.testing.capture_logs() as logs:
        found = catalog.newest_restorable()
    assert found is not None and found.step == 100
    skipped = [e for e in logs if e["event"] == "checkpoint_skipped"]
    assert [(e["step"], e["cause"]) for e in skipped] == [
        (200, "incomplete" if how == "truncate" else "corrupt")]
    assert shard in skipped[0]["detail"]
    assert not (tmp_path / "fresh" / shard).exists()  # a bad download never lands locally
    states = {c.step: c.state for c in catalog.list()}
    if how == "truncate":  # sizes are checked without downloading
        assert states[200] is CkptState.CORRUPT and catalog.verify(200)
    else:  # same size: only the checksum sees it
        assert states[200] is CkptState.COMMITTED and catalog.verify(200) == []
        assert catalog.verify(200, checksums=True) == [f"{shard}: sha256 differs from the manifest"]


@pytest.mark.parametrize("how", ["truncate", "bitflip"])
def test_corrupt_local_copy_is_replaced_from_store(make_s3_storage: Any, tmp_path: Path,
                                                   how: str) -> None:
    storage = make_s3_storage("jobs/local")
    local = tmp_path / "local"
    save_and_commit(storage, local, 100)
    shard = local / "global_step100/mp_rank_00_model_states.pt"
    good = shard.read_bytes()
    bad = bytearray(good)
    if how == "truncate":
        bad = bad[:100]
    else:
        bad[7] ^= 0x01
    shard.write_bytes(bytes(bad))

    found = Catalog(storage, local).newest_restorable()
    assert found is not None and (found.step, found.source) == (100, "downloaded")
    assert shard.read_bytes() == good
    # Without a store to repair from, a corrupt local copy is not restorable.
    found = Catalog(None, local).newest_restorable()
    assert found is not None and (found.step, found.source) == (100, "local")
    shard.write_bytes(bytes(bad))
    with structlog.testing.capture_logs() as logs:
        assert Catalog(None, local).newest_restorable() is None
    assert [(e["step"], e["cause"]) for e in logs if e["event"] == "checkpoint_skipped"] == [
        (100, "not_local")]
