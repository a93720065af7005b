"""Which local checkpoints the daemon still owes the store, and the uploader's retry backoff.

The end-to-end behaviour (workers gone, store down, daemon restarted, job COMPLETED only once
the final checkpoint is durable) is tests/integration/test_backlog_upload.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds3d.checkpoints.file_storage import FileStorage
from ds3d.checkpoints.manifest import CheckpointMeta, Layout
from ds3d.checkpoints.upload import Uploader, _Job, write_marker
from ds3d.daemon.backlog_upload import local_backlog

pytestmark = pytest.mark.timeout(30)

META = CheckpointMeta(job="j", job_id="id", tag="global_step10",
                      layout=Layout(tp=1, pp=1, dp=2, world_size=2))


def test_local_backlog_is_what_is_not_durable_yet(tmp_path: Path) -> None:
    files = ["global_step10/x.pt"]
    write_marker(tmp_path, 10, 0, "committed", files, META)
    write_marker(tmp_path, 10, 1, "uploaded", files, META)   # its part is in the store: done
    write_marker(tmp_path, 20, 0, "uploaded", files, META)   # rank 0 still owes the commit
    write_marker(tmp_path, 20, 1, "pending", files, META)
    write_marker(tmp_path, 30, 1, "failed", files, META, error="store down")
    write_marker(tmp_path, 40, 0, "failed", files, META, error="abandoned: parts missing")
    write_marker(tmp_path, 50, 0, "failed", files, META, error="local files unreadable: gone")
    got = {(p.step, p.rank, p.state, p.error) for p in local_backlog(tmp_path)}
    assert got == {(20, 0, "uploaded", ""), (20, 1, "pending", ""),
                   (30, 1, "failed", "store down")}


def test_retries_back_off_up_to_the_limit(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "store")
    fixed = Uploader(store, tmp_path / "l1", 0, 1, retry_interval=2.0)
    backing = Uploader(store, tmp_path / "l2", 0, 1, retry_interval=2.0,
                       max_retry_interval=10.0)
    try:
        job = _Job(step=1, files=[], meta=META)
        delays = []
        for attempts in range(1, 6):
            job.attempts = attempts
            delays.append((fixed._retry_delay(job), backing._retry_delay(job)))
        assert delays == [(2.0, 2.0), (2.0, 4.0), (2.0, 8.0), (2.0, 10.0), (2.0, 10.0)]
    finally:
        fixed.close()
        backing.close()
