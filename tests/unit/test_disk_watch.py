"""DiskWatch (daemon/disk.py): a full disk under a job becomes one diagnosis with the path, the
free bytes and the bytes needed, explains the workers' silence, and is stored even when the
full disk holds the daemon's own SQLite. On real, small tmpfs mounts that the tests fill."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ds3d.daemon import disk as disk_mod
from ds3d.daemon.disk import BALLAST_NAME, DiskWatch
from ds3d.daemon.store import Store
from ds3d.trainer.config import build_job_config

pytest_plugins = ["fixtures.tmpfs"]
pytestmark = pytest.mark.tmpfs


def _watch(store: Store, state_dir: Path, run_dir: Path) -> DiskWatch:
    cfg = build_job_config("tiny")
    store.create_job("j", cfg.model_dump_json(), "n1", str(run_dir))
    return DiskWatch(store, "j", state_dir, lambda job: cfg, reserve_bytes=1 << 20,
                     interval_s=0.0)


def _diagnoses(store: Store) -> list[tuple[str, dict]]:
    return [(e.cause, e.detail) for e in store.events(job="j", kinds=["diagnosis"])]


def test_a_full_job_folder_is_one_diagnosis_then_one_when_space_is_back(
        tmp_path: Path, small_tmpfs, fill_disk, monkeypatch) -> None:
    monkeypatch.setattr(disk_mod, "SILENCE_GRACE_S", 0.0)
    jobs = small_tmpfs(8 << 20)
    run_dir = jobs / "j"
    (run_dir / "ckpt" / "global_step10").mkdir(parents=True)
    (run_dir / "ckpt" / "global_step10" / "shard.pt").write_bytes(b"x" * 300_000)
    store = Store(tmp_path / "ds3d.db")
    watch = _watch(store, tmp_path, run_dir)
    watch.tick(store.get_job("j"))
    assert _diagnoses(store) == [] and not watch.blocking()

    filler = fill_disk(jobs)
    for _ in range(3):  # once per episode, not once per tick
        watch.tick(store.get_job("j"))
    [(cause, d)] = _diagnoses(store)
    assert cause == "disk_full" and d["mount"] == str(jobs)
    assert d["paths"] == {"job": str(run_dir), "local tier": str(run_dir / "ckpt")}
    assert d["bytes_free"] < 1 << 20
    assert d["bytes_needed"] == (1 << 20) + 300_000  # reserve + the newest checkpoint here
    job = store.get_job("j")
    assert job.message.startswith("disk full: the file system at " + str(jobs))
    assert f"({d['bytes_needed']} bytes) needed" in job.message
    assert watch.blocking()

    filler.unlink()
    watch.tick(store.get_job("j"))
    assert [c for c, _ in _diagnoses(store)] == ["disk_full", "disk_space_back"]
    assert not watch.blocking()
    assert store.get_job("j").message.startswith("disk space is back")


def test_a_checkpoint_that_will_not_fit_is_diagnosed_without_blocking(
        tmp_path: Path, small_tmpfs, fill_disk) -> None:
    jobs = small_tmpfs(8 << 20)
    run_dir = jobs / "j"
    (run_dir / "ckpt" / "global_step10").mkdir(parents=True)
    (run_dir / "ckpt" / "global_step10" / "shard.pt").write_bytes(b"x" * (3 << 20))
    store = Store(tmp_path / "ds3d.db")
    watch = _watch(store, tmp_path, run_dir)
    fill_disk(jobs, leave=2 << 20)  # room for reports, not for another 3 MiB checkpoint
    watch.tick(store.get_job("j"))
    [(cause, d)] = _diagnoses(store)
    assert cause == "disk_full" and d["bytes_needed"] == (1 << 20) + (3 << 20)
    assert "the next checkpoint will not fit" in store.get_job("j").message
    assert not watch.blocking()  # reports still flow: a real hang would still be caught


def test_a_full_disk_holding_only_the_local_tier_names_checkpoints_only(
        tmp_path: Path, small_tmpfs, fill_disk) -> None:
    """checkpoint.local_dir on its own small disk, filled: the diagnosis said 16 MiB were
    needed 'for reports, control files and the daemon's database' (on another disk) and that
    'reports and the daemon's writes wait for room (no hang is declared)', while a hang there
    was declared as it should be."""
    small = small_tmpfs(8 << 20)
    local = small / "ckpt"
    (local / "global_step10").mkdir(parents=True)
    (local / "global_step10" / "shard.pt").write_bytes(b"x" * (3 << 20))
    cfg = build_job_config("tiny", [f'checkpoint.local_dir="{local}"'])
    store = Store(tmp_path / "ds3d.db")
    store.create_job("j", cfg.model_dump_json(), "n1", str(tmp_path / "run"))
    watch = DiskWatch(store, "j", tmp_path, lambda job: cfg, reserve_bytes=1 << 20,
                      interval_s=0.0)
    fill_disk(small, leave=512 << 10)  # less than the reserve: it is not this disk's concern
    watch.tick(store.get_job("j"))
    [(cause, d)] = _diagnoses(store)
    assert cause == "disk_full" and d["paths"] == {"local tier": str(local)}
    assert d["bytes_needed"] == 3 << 20  # the next checkpoint, no reserve
    message = store.get_job("j").message
    assert "for reports" not in message and "no hang is declared" not in message
    assert "the next checkpoint will not fit" in message
    assert not watch.blocking()


def test_a_full_state_dir_is_diagnosed_in_its_own_database(small_tmpfs, fill_disk) -> None:
    state = small_tmpfs(32 << 20)
    store = Store(state / "ds3d.db")
    watch = _watch(store, state, state / "jobs" / "j")
    watch.tick(store.get_job("j"))
    assert (state / BALLAST_NAME).is_file()  # made while there is room
    filler = fill_disk(state)
    with pytest.raises(sqlite3.OperationalError, match="full"):
        for i in range(10_000):  # SQLite refuses once its pages run out
            store.record("j", "note", "x" * 4000, detail={"i": i})
    watch.tick(store.get_job("j"))  # releases the ballast, then stores the diagnosis
    assert not (state / BALLAST_NAME).exists()
    [(cause, d)] = _diagnoses(store)
    assert cause == "disk_full" and "state" in d["paths"] and d["mount"] == str(state)
    filler.unlink()
    watch.tick(store.get_job("j"))
    assert [c for c, _ in _diagnoses(store)] == ["disk_full", "disk_space_back"]
    assert (state / BALLAST_NAME).is_file()
    store.record("j", "note", "writes work again")  # no transaction was left open
