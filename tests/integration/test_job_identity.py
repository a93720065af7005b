"""Two jobs pointed at the same store prefix (issue 17, job identity): the second is refused
before anything is created, naming both jobs, and real workers of another run neither load nor
delete the first job's checkpoints. Real ds3dd and ds3dctl, real workers under torchrun, a
file store and a real S3 server (moto_server over HTTP)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from ds3d.checkpoints import layout
from ds3d.checkpoints.identity import read_owner
from ds3d.checkpoints.storage import Storage, open_storage

from support import records, worker_env
from test_daemon_support import DaemonProc, kill_job_processes, pb, tiny_job_json

pytest_plugins = ["fixtures.s3"]


def store_url(kind: str, tmp_path: Path, bucket: str | None) -> str:
    return f"s3://{bucket}/jobs" if kind == "s3" else f"file://{tmp_path}/store"


def snapshot(storage: Storage) -> dict[str, bytes]:
    return {o.key: storage.get_bytes(o.key) for o in storage.list()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_second_job_on_an_owned_prefix_is_refused_before_any_side_effect(
        tmp_path: Path, kind: str, request: pytest.FixtureRequest) -> None:
    env: dict[str, str] = {}
    bucket = None
    url = store_url(kind, tmp_path, bucket)
    prefix: Storage = open_storage(f"{url}/shared") if kind == "file" else None  # type: ignore
    if kind == "s3":
        moto = request.getfixturevalue("moto_server")
        bucket = request.getfixturevalue("s3_bucket")
        env = moto.env()
        url = store_url(kind, tmp_path, bucket)
        prefix = moto.storage(bucket, "jobs/shared")
    first = DaemonProc(tmp_path / "a", worker_dir=tmp_path / "w", extra_env={
        **env, "FAKE_STEP_S": "0.5"}, node="node-a")
    second = DaemonProc(tmp_path / "b", worker_dir=tmp_path / "w", extra_env=env, node="node-b")
    try:
        first.start()
        second.start()
        start(first, url, steps=1000)
        first.wait_state("shared", "RUNNING")
        owner = read_owner(prefix)
        assert owner is not None and owner.job == "shared"
        before = snapshot(prefix)

        with pytest.raises(grpc.RpcError) as refused:
            start(second, url, steps=10)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        message = refused.value.details()
        assert owner.job_id in message and "belongs to job 'shared'" in message, message
        refused_id = message.split("(id ")[-1].split(")")[0]
        assert refused_id != owner.job_id and len(refused_id) == 32  # names both jobs
        assert not (second.state_dir / "jobs" / "shared").exists()  # no folder, no row
        assert json.loads(second.ctl("list", "--all", "--json").stdout) == []
        assert snapshot(prefix) == before  # not one object written
        assert first.job("shared")["state"] == "RUNNING"
    finally:
        for d in (first, second):
            d.stop()
            kill_job_processes(d.state_dir)


def start(d: DaemonProc, url: str, steps: int) -> None:
    """StartJob through gRPC, as ds3dctl sends it."""
    channel, stub = d.stub()
    with channel:
        stub.StartJob(pb.StartJobRequest(config_json=tiny_job_json(
            name="shared", train={"steps": steps}, checkpoint={"store": url})), timeout=60)


def run_worker(run_dir: Path, sets: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "ds3d.trainer.worker", "--run-dir", str(run_dir), "--config", "tiny"]
    for s in sets:
        cmd += ["--set", s]
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, env=worker_env(**env), capture_output=True, text=True,
                          timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_workers_neither_load_nor_delete_another_jobs_checkpoints(
        tmp_path: Path, moto_server, s3_bucket) -> None:
    """Run A (real workers, S3) commits steps 2 and 4 and keeps only the newest. Run B, its own
    job (another run directory, so another id) with the same name and store, would have
    resumed from A's step 4 and, by retention, deleted it: it refuses before it reads or
    writes anything. A's next run still owns the prefix and resumes from its step 4."""
    url = f"s3://{s3_bucket}/jobs"
    sets = ["train.steps=4", "checkpoint.interval=2", "checkpoint.keep_last=1",
            f'checkpoint.store="{url}"']
    a, b = tmp_path / "a", tmp_path / "b"
    proc = run_worker(a, sets, moto_server.env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    job_a = (a / "job_id").read_text().strip()
    prefix = moto_server.storage(s3_bucket, "jobs/tiny")
    before = snapshot(prefix)
    assert layout.manifest_key(4) in before and layout.manifest_key(2) not in before
    assert json.loads(before[layout.manifest_key(4)])["job_id"] == job_a

    proc = run_worker(b, [*sets[:-1], "train.steps=8", sets[-1]], moto_server.env())
    assert proc.returncode != 0
    job_b = (b / "job_id").read_text().strip()
    assert job_b != job_a
    assert f"belongs to job 'tiny' (id {job_a})" in proc.stderr and job_b in proc.stderr
    assert not [r for r in records(b, 0) if r["kind"] == "checkpoint"]  # nothing loaded
    assert snapshot(prefix) == before  # nothing deleted, overwritten or added

    proc = run_worker(a, [*sets[:-1], "train.steps=6", sets[-1]], moto_server.env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = [r["step"] for r in records(a, 0, "checkpoint") if r["phase"] == "loaded"]
    assert loaded == [4]
