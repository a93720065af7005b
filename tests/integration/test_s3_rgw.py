"""Against Ceph RADOS Gateway, a production S3 server that (unlike moto) checks signatures:
wrong keys and missing buckets are told apart from outages, and a real gateway restart is
ridden out by the retries. The shared conformance suite also runs on RGW
(test_s3_conformance.py, param "rgw"). Skipped with the reason when Ceph is not installed."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import structlog

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog
from ds3d.checkpoints.upload import commit_checkpoint, upload_rank_files
from ds3d.trainer.errors import NotFoundError, PermissionError_, TransientStorageError

from fixtures.ckpt import meta_for, write_fake_checkpoint

pytest_plugins = ["fixtures.s3", "fixtures.rgw"]
pytestmark = [pytest.mark.rgw, pytest.mark.timeout(180)]


def test_wrong_secret_key(make_rgw_storage: Any) -> None:
    storage = make_rgw_storage("job", secret_key="not-the-secret")
    with pytest.raises(PermissionError_, match="SignatureDoesNotMatch") as info:
        storage.check_access()
    assert "AWS_SECRET_ACCESS_KEY" in str(info.value) and not info.value.retryable


def test_unknown_access_key(make_rgw_storage: Any) -> None:
    storage = make_rgw_storage("job", access_key="NOSUCHKEY", secret_key="x")
    with pytest.raises(PermissionError_, match="InvalidAccessKeyId"):
        storage.check_access()


def test_missing_bucket(rgw_server: Any, aws_env: None) -> None:
    storage = rgw_server.storage("ds3d-never-created", "job")
    with pytest.raises(NotFoundError, match="create it or fix"):
        storage.check_access()


def test_checkpoint_roundtrip(make_rgw_storage: Any, tmp_path: Path) -> None:
    storage = make_rgw_storage("jobs/rgw")
    files = write_fake_checkpoint(tmp_path / "local", 100, world_size=2,
                                  big={"global_step100/mp_rank_00_model_states.pt": 11 << 20})
    for rank in (0, 1):
        upload_rank_files(storage, 100, rank, tmp_path / "local", files[rank])
    commit_checkpoint(storage, 100, 2, meta_for(100, 2), timeout=10)
    found = Catalog(storage, tmp_path / "fresh").newest_restorable()
    assert found is not None and (found.step, found.source) == (100, "downloaded")
    assert storage.exists(layout.manifest_key(100))


def test_gateway_outage_then_restart(rgw_cluster: Any, make_rgw_storage: Any) -> None:
    """kill -9 of radosgw: calls fail as transient (fast, not as credential errors), and a call
    made while it restarts succeeds through the retries, with the objects kept."""
    quick = make_rgw_storage("jobs/outage", outage_retries=1, backoff_base=0.05)
    patient = make_rgw_storage("jobs/outage", outage_retries=8, backoff_base=0.2, backoff_max=1.0)
    quick.put_bytes("before", b"1")
    rgw_cluster.kill_gateway()
    restart = threading.Timer(1.5, rgw_cluster.start_gateway)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransientStorageError, match="cannot reach"):
            quick.check_access()
        assert time.monotonic() - t0 < 1.5
        restart.start()
        with structlog.testing.capture_logs() as logs:
            patient.put_bytes("during", b"2")
    finally:
        if restart.ident is not None:
            restart.join()
        else:  # failed before the timer started: bring the gateway back for later tests
            rgw_cluster.start_gateway()
    assert patient.get_bytes("before") == b"1" and patient.get_bytes("during") == b"2"
    assert any(e["event"] == "storage_retry" for e in logs)
