"""`ds3dctl start` refuses a job whose checkpoint store cannot work, before any worker starts:
wrong secret key and missing bucket against Ceph RGW (which checks signatures, unlike moto), an
unreachable endpoint, and a missing data file. Real ds3dd, real ds3dctl, real S3 server."""

from __future__ import annotations

import uuid

import pytest

from test_daemon_support import DaemonProc, kill_job_processes

pytest_plugins = ["fixtures.s3", "fixtures.rgw"]


def _daemon(tmp_path, env):
    d = DaemonProc(tmp_path / "state", extra_env={"AWS_CONFIG_FILE": "/dev/null",
                                                  "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
                                                  "AWS_DEFAULT_REGION": "us-east-1", **env})
    return d.start()


def _start(d, *args):
    r = d.ctl("start", "tiny", "--name", "j1", *args)
    assert d.ctl("list", "--all").returncode == 0  # still serving
    return r


@pytest.mark.rgw  # moto accepts any credentials: only RGW can refuse a wrong secret
@pytest.mark.timeout(180)
def test_wrong_secret_and_missing_bucket_are_refused_before_launch(tmp_path, rgw_server):
    bucket = f"ds3d-pre-{uuid.uuid4().hex[:8]}"
    rgw_server.client().create_bucket(Bucket=bucket)
    wrong = _daemon(tmp_path / "a", {"AWS_ACCESS_KEY_ID": rgw_server.access_key,
                                     "AWS_SECRET_ACCESS_KEY": "not-the-secret",
                                     "AWS_ENDPOINT_URL": rgw_server.url})
    try:
        r = _start(wrong, "--store", f"s3://{bucket}/ds3d")
        assert r.returncode == 2
        assert "checkpoint.store" in r.stderr and "not started" in r.stderr
        assert "secret" in r.stderr.lower() or "signature" in r.stderr.lower(), r.stderr
        assert not (wrong.state_dir / "jobs" / "j1").exists()  # nothing was created or launched
    finally:
        wrong.stop()
        kill_job_processes(wrong.state_dir)
    right = _daemon(tmp_path / "b", {"AWS_ACCESS_KEY_ID": rgw_server.access_key,
                                     "AWS_SECRET_ACCESS_KEY": rgw_server.secret_key,
                                     "AWS_ENDPOINT_URL": rgw_server.url})
    try:
        r = _start(right, "--store", "s3://no-such-bucket-ds3d/x")
        assert r.returncode == 2 and "no-such-bucket-ds3d" in r.stderr
        assert "create it" in r.stderr.lower() or "does not exist" in r.stderr.lower(), r.stderr
    finally:
        right.stop()
        kill_job_processes(right.state_dir)


@pytest.mark.timeout(120)
def test_unreachable_endpoint_and_missing_data_are_refused(tmp_path):
    from fixtures.s3 import free_port

    d = _daemon(tmp_path, {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})
    try:
        r = _start(d, "--store", "s3://bucket/x")
        assert r.returncode == 2 and "checkpoint.store" in r.stderr, r.stderr
        r = _start(d, "--set", 'data.source="/nonexistent/tokens.bin"')
        assert r.returncode == 2 and "/nonexistent/tokens.bin" in r.stderr
        assert "does not exist" in r.stderr
    finally:
        d.stop()
        kill_job_processes(d.state_dir)
