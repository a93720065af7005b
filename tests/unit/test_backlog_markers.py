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


def test_the_backlog_retry_limit_is_a_checked_daemon_flag(tmp_path: Path, capsys) -> None:
    """ds3dd --backlog-retry-max: the backlog's uploaders back off up to it (default 30 s);
    below the first retry's 2 s, or not a number, ds3dd refuses to start (exit code 2)."""
    from ds3d.daemon import main as ds3dd_main
    from ds3d.daemon.backlog_upload import MAX_RETRY_S, BacklogUpload
    from ds3d.trainer.config import build_job_config

    parse = ds3dd_main.build_parser().parse_args
    assert parse([]).backlog_retry_max == MAX_RETRY_S == 30.0
    assert parse(["--backlog-retry-max", "5"]).backlog_retry_max == 5.0
    for bad, why in (("1", "is below 2 s"), ("x", "is not a number of seconds above 0")):
        with pytest.raises(SystemExit) as exc:
            ds3dd_main.main(["--state-dir", str(tmp_path / "s"), "--backlog-retry-max", bad])
        assert exc.value.code == 2
        assert f"--backlog-retry-max: {bad!r} {why}" in capsys.readouterr().err
    local = tmp_path / "local"
    write_marker(local, 10, 0, "failed", ["global_step10/x.pt"], META, error="store down")
    cfg = build_job_config("tiny", [f'checkpoint.store="file://{tmp_path}/st"'], name="j")
    backlog = BacklogUpload.start_if_needed(cfg, "id", tmp_path / "run", local, max_retry_s=5.0)
    assert backlog is not None
    try:
        assert [up.max_retry_interval for up in backlog._uploaders] == [5.0]
    finally:
        backlog.close()


def test_the_workers_retry_interval_is_a_checked_node_wide_variable(tmp_path: Path,
                                                                   capsys) -> None:
    """DS3D_UPLOAD_RETRY_S (ds3dd's environment, inherited by its workers): the seconds before
    a worker's failed upload is attempted again, default 30; below 1 s or not a number, ds3dd
    refuses to start (exit code 2) and a worker refuses its configuration."""
    from ds3d.checkpoints.errors import ConfigError
    from ds3d.checkpoints.upload import retry_interval_from_env
    from ds3d.daemon import main as ds3dd_main

    assert retry_interval_from_env({}) == retry_interval_from_env({"DS3D_UPLOAD_RETRY_S": " "})
    assert retry_interval_from_env({}) == 30.0
    assert retry_interval_from_env({"DS3D_UPLOAD_RETRY_S": "2.5"}) == 2.5
    for bad in ("0.5", "-3", "nan", "inf", "soon"):
        with pytest.raises(ConfigError, match=f"DS3D_UPLOAD_RETRY_S='{bad}': expected a "
                           "number of seconds, at least 1"):
            retry_interval_from_env({"DS3D_UPLOAD_RETRY_S": bad})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS3D_UPLOAD_RETRY_S", "0")
        with pytest.raises(SystemExit) as exc:
            ds3dd_main.main(["--state-dir", str(tmp_path / "s")])
    assert exc.value.code == 2
    assert "ds3dd: DS3D_UPLOAD_RETRY_S='0': expected" in capsys.readouterr().err


def test_the_head_waits_for_a_commit_another_node_owes(tmp_path: Path) -> None:
    """A head whose newest step's part is uploaded, with rank 0 (the committer) on another
    node, has nothing to upload but must not end the job before that step's MANIFEST is in
    the store: start_if_needed(remote_commit=True) returns a backlog naming it until then."""
    from ds3d.checkpoints import layout
    from ds3d.checkpoints.storage import open_storage
    from ds3d.daemon.backlog_upload import BacklogUpload, awaiting_commit
    from ds3d.trainer.config import build_job_config

    local, files = tmp_path / "local", ["global_step10/x.pt"]
    cfg = build_job_config("tiny", ["parallel.dp=2", f'checkpoint.store="file://{tmp_path}/s"'],
                           name="j")
    assert awaiting_commit(local) is None  # nothing saved here
    write_marker(local, 10, 1, "uploaded", files, META)
    write_marker(local, 20, 1, "uploaded", files, META)  # the final step: rank 0 elsewhere
    assert local_backlog(local) == [] and awaiting_commit(local) == 20
    # a node that does not decide the end (a share node) has nothing to do
    assert BacklogUpload.start_if_needed(cfg, "id", tmp_path / "run", local) is None
    backlog = BacklogUpload.start_if_needed(cfg, "id", tmp_path / "run", local,
                                            remote_commit=True)
    assert backlog is not None
    try:
        assert backlog.steps == [20] and backlog.pending() == []
        assert backlog.not_durable() == [20]
        store = open_storage(f"file://{tmp_path}/s/j")
        store.put_bytes(layout.manifest_key(20), b"{}")
        assert backlog.not_durable() == []
    finally:
        backlog.close()
    # committed meanwhile: no backlog at all
    assert BacklogUpload.start_if_needed(cfg, "id", tmp_path / "run", local,
                                         remote_commit=True) is None
    # rank 0's marker here, or this node's part not uploaded: local_backlog's business
    write_marker(local, 30, 1, "pending", files, META)
    assert awaiting_commit(local) is None
    write_marker(local, 40, 0, "committed", files, META)
    write_marker(local, 40, 1, "uploaded", files, META)
    assert awaiting_commit(local) is None
