"""DeepSpeed's `latest` in the local tier names the newest committed tag that is there, also
after a delete (retention or rollback) removed the one it named."""

import shutil
import threading

from ds3d.checkpoints.catalog import Catalog
from ds3d.checkpoints.deepspeed_latest import refresh_local_latest
from ds3d.checkpoints.manifest import (
    CheckpointMeta,
    Layout,
    manifest_from_entries,
    save_local_manifest,
)


def _committed(local, step, with_folder=True):
    tag = f"global_step{step}"
    if with_folder:
        (local / tag).mkdir(parents=True)
        (local / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    meta = CheckpointMeta(job="j", tag=tag, layout=Layout(tp=1, pp=1, dp=1, world_size=1))
    save_local_manifest(local, manifest_from_entries(step, meta, []))


def test_latest_follows_commits_and_deletes(tmp_path):
    assert refresh_local_latest(tmp_path) is None and not (tmp_path / "latest").exists()
    _committed(tmp_path, 5)
    _committed(tmp_path, 10)
    (tmp_path / "global_step15").mkdir()  # saved, not committed: never named
    _committed(tmp_path, 20, with_folder=False)  # committed elsewhere, not in this tier
    assert refresh_local_latest(tmp_path) == "global_step10"
    assert (tmp_path / "latest").read_text() == "global_step10"

    Catalog(None, tmp_path).delete(10)  # a rollback to 5 drops the newer ones
    assert (tmp_path / "latest").read_text() == "global_step5"
    Catalog(None, tmp_path).delete(5)
    assert not (tmp_path / "latest").exists()


def test_concurrent_refreshes_never_fail_and_end_on_the_newest_tag(tmp_path):
    """Rank 0's upload thread refreshes `latest` after a commit while its main thread's rollback
    deletes a step and refreshes too (CI of 12-06: both wrote one temporary name, and one's
    rename found it gone). Threads racing deletes and re-creations never fail, and the refresh
    after the last change names the newest tag present."""
    _committed(tmp_path, 5)
    _committed(tmp_path, 10)
    errors: list[BaseException] = []
    stop = threading.Event()

    def refresher() -> None:
        while not stop.is_set():
            try:
                refresh_local_latest(tmp_path)
            except BaseException as e:  # noqa: BLE001 - any failure fails the test
                errors.append(e)
                return

    threads = [threading.Thread(target=refresher) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(150):  # step 10's folder comes and goes: `latest` flips between tags
            shutil.rmtree(tmp_path / "global_step10")
            refresh_local_latest(tmp_path)
            (tmp_path / "global_step10").mkdir()
            refresh_local_latest(tmp_path)
        shutil.rmtree(tmp_path / "global_step10")
        refresh_local_latest(tmp_path)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert (tmp_path / "latest").read_text() == "global_step5"
    assert not list(tmp_path.glob(".latest.tmp*"))
