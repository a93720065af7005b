"""A full disk fails a save, never training, and never removes an older checkpoint (issue 19,
goal 4): the checkpoint writer, the file store and the worker's reports on a real, small
tmpfs that the test fills."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ds3d.checkpoints.disk_space import Shortage, free_bytes, is_disk_full
from ds3d.checkpoints.file_storage import FileStorage
from ds3d.checkpoints.snapshot import SnapshotCheckpointEngine
from ds3d.trainer.errors import StorageError

pytest_plugins = ["fixtures.tmpfs"]
pytestmark = pytest.mark.tmpfs


class _Info:
    def __init__(self, tag: str) -> None:
        self.tag = tag


def _save(engine: SnapshotCheckpointEngine, folder: Path, tag: str, mib: int) -> list[str]:
    (folder / tag).mkdir(parents=True, exist_ok=True)
    engine.create(_Info(tag))  # type: ignore[arg-type]
    paths = []
    for i in range(2):
        path = str(folder / tag / f"part{i}.pt")
        engine.save({"w": torch.ones(mib << 18)}, path)  # mib MiB of fp32
        paths.append(path)
    engine.commit(_Info(tag))  # type: ignore[arg-type]
    engine.wait()
    return paths


def test_a_save_that_does_not_fit_is_dropped_and_reported(small_tmpfs, fill_disk) -> None:
    disk = small_tmpfs(16 << 20)
    durable: list[str] = []
    failed: list[tuple[str, list[str], Shortage, str]] = []
    engine = SnapshotCheckpointEngine(on_durable=lambda tag, paths: durable.append(tag),
                                      on_failed=lambda *a: failed.append(a))
    good = _save(engine, disk, "global_step10", 2)  # 4 MiB: fits
    assert durable == ["global_step10"] and not failed
    before = {p: Path(p).read_bytes() for p in good}
    filler = fill_disk(disk, leave=3 << 20)  # room for one 2 MiB file, not for two
    paths = _save(engine, disk, "global_step20", 2)
    assert durable == ["global_step10"]
    [(tag, got_paths, short, error)] = failed
    assert tag == "global_step20" and got_paths == paths
    assert short.needed >= 4 << 20 and short.free == free_bytes(disk)
    assert short.free < short.needed and short.path == str(disk / "global_step20")
    assert "No space left" in error or "unexpected pos" in error
    # nothing of the failed save is left, temp files included; the older save is untouched
    assert not (disk / "global_step20").exists()
    assert {p: Path(p).read_bytes() for p in good} == before
    # the next save works once there is room again (and the engine raised nothing)
    filler.unlink()
    _save(engine, disk, "global_step30", 2)
    assert durable == ["global_step10", "global_step30"]
    engine.close()


def test_a_save_whose_files_fit_but_not_its_upload_marker_is_dropped_and_reported(
        small_tmpfs, fill_disk, tmp_path: Path) -> None:
    """The save's files take the disk's last pages; the uploader's `pending` marker, written
    next on the writer thread (engine_io's on_durable), gets ENOSPC. That must fail this save
    like one that did not fit; it used to be kept as the writer's error, raised by the next
    save (the worker crashed, the agent restarted its group) and left the uploader counting
    a job it never queued (`wait` never returned: the worker's stop never ended)."""
    from ds3d.checkpoints.identity import new_job_id
    from ds3d.checkpoints.storage import open_storage
    from ds3d.checkpoints.upload import Uploader

    from fixtures.ckpt import meta_for

    disk = small_tmpfs(16 << 20)
    uploader = Uploader(open_storage(f"file://{tmp_path}/store"), disk, 0, 1)
    failed: list[tuple[str, list[str], Shortage, str]] = []

    def durable(tag: str, paths: list[str]) -> None:  # as engine_io.CheckpointIO._on_durable
        step = int(tag.removeprefix("global_step"))
        uploader.submit(step, [os.path.relpath(p, disk) for p in paths],
                        meta_for(step).model_copy(update={"job_id": new_job_id()}),
                        written=engine.written(tag))

    engine = SnapshotCheckpointEngine(on_durable=durable, on_failed=lambda *a: failed.append(a))
    try:
        # the pages two 1 MiB files take, measured by the same save on another disk
        probe_engine = SnapshotCheckpointEngine()
        probe = _save(probe_engine, tmp_path / "probe", "global_step10", 1)
        probe_engine.close()
        pages = sum(-(-os.path.getsize(p) // 4096) * 4096 for p in probe)
        filler = fill_disk(disk, leave=pages)
        paths = _save(engine, disk, "global_step10", 1)
        [(tag, got_paths, short, error)] = failed
        assert tag == "global_step10" and got_paths == paths and "No space left" in error
        # measured when the marker was refused: the full disk, not the room its files left
        assert short.free < short.needed and short.path == str(disk / "global_step10")
        assert uploader.wait(5) and uploader.pending() == []  # nothing counted, nothing queued
        left = [p for p in disk.rglob("*") if p.is_file() and p != filler]
        assert left == [] and not (disk / "global_step10").exists()
        filler.unlink()  # room again: the next save goes through and is uploaded
        _save(engine, disk, "global_step20", 1)
        assert [f[0] for f in failed] == ["global_step10"]
        assert uploader.wait(30) and uploader.pending() == []
        assert (disk / ".ds3d" / "step-00000020" / "rank-00000.json").is_file()
    finally:
        uploader.close(10)
        engine.close()


def test_file_store_full_names_path_free_and_needed_and_leaves_no_temp(
        small_tmpfs, fill_disk, tmp_path: Path) -> None:
    disk = small_tmpfs(4 << 20)
    store = FileStorage(disk / "store")
    local = tmp_path / "shard.pt"  # another file system: the store must copy
    local.write_bytes(os.urandom(2 << 20))
    fill_disk(disk, leave=1 << 20)
    with pytest.raises(StorageError) as err:
        store.put_file(local, "ckpt/step-1/files/shard.pt")
    text = str(err.value)
    assert str(disk / "store" / "ckpt" / "step-1" / "files" / "shard.pt") in text
    assert f"({2 << 20} bytes) needed" in text and "free (" in text
    assert is_disk_full(err.value)
    assert [p.name for p in (disk / "store").rglob("*") if p.is_file()] == []


def test_disk_full_is_recognised_in_its_shapes() -> None:
    assert is_disk_full(OSError(28, "No space left on device"))
    import sqlite3
    assert is_disk_full(sqlite3.OperationalError("database or disk is full"))
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")  # noqa: B904
    except RuntimeError as e:
        assert is_disk_full(e)
    assert not is_disk_full(OSError(5, "Input/output error"))
    assert not is_disk_full(json.JSONDecodeError("x", "", 0))


def test_reports_are_held_while_the_disk_is_full_and_arrive_in_order(small_tmpfs, fill_disk,
                                                                      capfd) -> None:
    from ds3d.trainer.report import Reporter, read_records, report_path

    run_dir = small_tmpfs(1 << 20)
    rep = Reporter(run_dir, rank=3, restart=0)
    rep.emit("step", step=1)
    filler = fill_disk(run_dir)
    for step in range(2, 400):  # ~40 KB of records: none fits
        rep.emit("step", step=step, detail="x" * 40)
    # what fitted in the file's last page went in; the rest is held, in order, nothing torn
    held = rep.held()
    assert held > 300
    records, offset = read_records(report_path(run_dir, 3))
    assert [r["step"] for r in records] == list(range(1, 400 - held))
    assert offset == report_path(run_dir, 3).stat().st_size
    err = capfd.readouterr().err
    assert "this rank's reports" in err and str(report_path(run_dir, 3)) in err
    assert err.count("no space left") == 1  # said once, not per record
    filler.unlink()
    rep.emit("step", step=400)
    assert rep.held() == 0
    records, _ = read_records(report_path(run_dir, 3))
    assert [r["step"] for r in records] == list(range(1, 401))
    assert "reports are written again" in capfd.readouterr().err
    rep.close()


def test_deepspeeds_recovery_script_copy_never_fails_a_save(small_tmpfs, fill_disk) -> None:
    """DeepSpeed's save copies zero_to_fp32.py & co. into the checkpoint folder itself (rank 0,
    training thread, a truncating copy): on a full disk that raised ENOSPC out of the save and
    ended the worker. Wrapped (engine_io.save), it copies once there is room, skips a copy that
    does not fit, and does not rewrite the copies at every later save."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from ds3d.checkpoints.recovery_scripts import copy_recovery_scripts_once

    class Engine:  # DeepSpeed's own two methods, without building a whole engine
        _copy_recovery_script = DeepSpeedEngine._copy_recovery_script
        _change_recovery_script_permissions = \
            DeepSpeedEngine._change_recovery_script_permissions

    import deepspeed.utils

    source = Path(deepspeed.utils.__file__).parent / "zero_to_fp32.py"
    disk = small_tmpfs(1 << 20)
    filler = fill_disk(disk)
    engine = Engine()
    with pytest.raises(OSError) as err:  # DeepSpeed on its own
        engine._copy_recovery_script(str(disk))
    assert is_disk_full(err.value)
    copy_recovery_scripts_once(engine)
    copy_recovery_scripts_once(engine)  # every save calls it: wrapped once
    engine._copy_recovery_script(str(disk))  # skipped, nothing raised
    filler.unlink()
    engine._copy_recovery_script(str(disk))
    assert (disk / "zero_to_fp32.py").read_bytes() == source.read_bytes()
    fill_disk(disk)
    engine._copy_recovery_script(str(disk))  # copied already: not truncated and rewritten
    assert (disk / "zero_to_fp32.py").read_bytes() == source.read_bytes()
