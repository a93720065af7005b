"""Storage gets a job's checkpoint settings, never its JobConfig: `JobConfig.checkpoint_settings()`
is the one place they are taken from the configuration, so each field must carry what the job
set (a field left at its default here would silently change retention, the store or a
restore's architecture check)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ds3d.checkpoints.engine_io import open_job_storage
from ds3d.checkpoints.file_storage import FileStorage
from ds3d.checkpoints.settings import CheckpointSettings
from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def test_every_setting_comes_from_the_job(tmp_path: Path) -> None:
    cfg = build_job_config("tiny", [
        'checkpoint.store="s3://bucket/durable"', f'checkpoint.local_dir="{tmp_path}/l"',
        "checkpoint.keep_last=7", "checkpoint.keep_every=50", "checkpoint.cleanup_grace_s=90",
        "parallel.zero_stage=2", "checkpoint.s3.outage_retries=4"], name="settings-job")
    s = cfg.checkpoint_settings()
    assert s == CheckpointSettings(
        job="settings-job", store="s3://bucket/durable", local_dir=f"{tmp_path}/l",
        keep_last=7, keep_every=50, cleanup_grace_s=90.0, model_hash=cfg.model_hash(),
        zero_stage=2, s3={**{k: None for k in cfg.checkpoint.s3.model_dump()},
                          "outage_retries": 4})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.keep_last = 1  # type: ignore[misc]


def test_job_storage_is_the_jobs_prefix(tmp_path: Path) -> None:
    """The job's prefix below checkpoint.store; the default store is a folder of the run dir."""
    given = build_job_config("tiny", [f'checkpoint.store="file://{tmp_path}/durable"'], name="a")
    storage = open_job_storage(given.checkpoint_settings(), tmp_path / "run")
    assert isinstance(storage, FileStorage) and storage.root == tmp_path / "durable" / "a"
    default = build_job_config("tiny", name="b")
    storage = open_job_storage(default.checkpoint_settings(), tmp_path / "run")
    assert isinstance(storage, FileStorage) and storage.root == tmp_path / "run" / "store" / "b"


@pytest.mark.parametrize("store", [None, "file:///tmp/durable"])
def test_s3_transfer_settings_without_an_s3_store_are_refused(store: str | None) -> None:
    """[checkpoint.s3] beside a file:// store (or none: the job folder's) would be ignored:
    refused, naming the setting and what to change."""
    sets = ["checkpoint.s3.outage_retries=4", "checkpoint.s3.max_concurrency=2"]
    if store:
        sets.append(f'checkpoint.store="{store}"')
    with pytest.raises(ConfigError, match=r"checkpoint\.s3\.max_concurrency \(and 1 more\) "
                       r"applies to an s3:// store.*remove \[checkpoint\.s3\]"):
        build_job_config("tiny", sets)


def test_a_stored_job_with_s3_settings_on_a_file_store_stays_runnable(tmp_path: Path) -> None:
    """The rule holds where a job is built or submitted (ds3dctl, ds3dd's StartJob), not at a
    worker's (re)start: a job stored before it keeps running after an upgrade."""
    from ds3d.trainer.config import JobConfig, validate_for_daemon, validate_job

    good = build_job_config("tiny", ['checkpoint.store="s3://b/p"',
                                     "checkpoint.s3.outage_retries=4"])
    stored = JobConfig.parse_json(good.model_copy(update={"checkpoint": good.checkpoint.model_copy(
        update={"store": f"file://{tmp_path}/durable"})}).dump_json(), "job.json")
    validate_job(stored)  # what every worker start checks
    with pytest.raises(ConfigError, match="checkpoint.s3.outage_retries applies to an s3://"):
        validate_for_daemon(stored)
