"""Checkpoints through a real S3 server (moto_server over HTTP): train, save to S3, wipe the
node-local disk, restore in a fresh process group, identical losses afterwards. And a rollback
to an older step through `control/restore.json` (what `ds3dctl rollback` writes)."""

import json
import shutil

import pytest

from support import losses, records, torchrun

pytest_plugins = ["fixtures.s3"]

SETS = ["train.steps=8", "train.warmup_steps=2", "parallel.tp=2", "parallel.pp=2",
        "checkpoint.interval=2"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_s3_round_trip_after_local_disk_is_wiped(tmp_path, moto_server, s3_bucket):
    store = [f'checkpoint.store="s3://{s3_bucket}/jobs"']
    ref, run = tmp_path / "ref", tmp_path / "run"
    torchrun(ref, 4, sets=SETS)
    torchrun(run, 4, sets=SETS + store, extra=["--stop-at-step", "4"], env=moto_server.env())
    keys = {o["Key"] for o in moto_server.client().list_objects_v2(
        Bucket=s3_bucket, Prefix="jobs/tiny/ckpt/")["Contents"]}
    assert "jobs/tiny/ckpt/step-00000004/MANIFEST.json" in keys
    assert any(k.startswith("jobs/tiny/ckpt/step-00000004/files/global_step4/") for k in keys)

    shutil.rmtree(run / "ckpt")  # the node's disk is gone; only S3 remains
    torchrun(run, 4, sets=SETS + store, env=moto_server.env())
    loaded = [r for r in records(run, 0, "checkpoint") if r["phase"] == "loaded"]
    assert [r["step"] for r in loaded] == [4]
    assert (run / "ckpt" / "global_step4").is_dir()  # downloaded and verified before loading
    want, got = losses(ref), losses(run)
    assert sorted(got) == list(range(1, 9))
    for step in range(1, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rollback_to_an_older_step(tmp_path):
    run = tmp_path / "run"
    sets = ["train.steps=6", "checkpoint.interval=2", "parallel.pp=2"]
    torchrun(run, 2, sets=sets)
    first = losses(run)
    (run / "control").mkdir(exist_ok=True)
    (run / "control" / "restore.json").write_text(json.dumps({"step": 2, "id": 1}))
    torchrun(run, 2, sets=sets)
    loaded = [r for r in records(run, 0, "checkpoint") if r["phase"] == "loaded"]
    assert [r["step"] for r in loaded] == [2]
    rolled = [r for r in records(run, 0, "checkpoint") if r["phase"] == "rolled_back"]
    assert rolled and "[4, 6]" in rolled[0]["detail"]
    assert not (run / "control" / "restore.json").exists()
    steps = [r["step"] for r in records(run, 0, "step")]
    assert steps == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6]  # steps 3-6 trained again from step 2
    again = losses(run)
    for step in range(3, 7):
        assert again[step] == pytest.approx(first[step], rel=1e-6, abs=0)
