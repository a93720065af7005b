"""`make demo`: the main job on embedded defaults, end to end on this machine.

Starts a local S3 object store (`moto_server` on a loopback port, bucket `ds3d-demo`), then
`ds3dd` (state in ./.ds3d, listening on a Unix socket there) with that endpoint in its
environment, the way an operator points ds3dd at MinIO or Ceph RGW; submits the `tiny` preset as
a 3D-parallel job (TP 2 x PP 2 x DP 1 = 4 worker processes on CPU, gloo) whose checkpoints are
uploaded to `s3://ds3d-demo/jobs` through boto3 and committed with their manifest; follows its
events to the end, prints its status and checkpoints and the objects in the bucket, and stops
both. Every step goes through the real binaries (`ds3dd`, `ds3dctl`), as an operator would run
them. `--store file` uses the embedded file store (a folder in the job's run directory)
instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BUCKET = "ds3d-demo"
DEMO_KEYS = {"AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo-secret",
             "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
             "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def _ctl(addr: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ds3d.daemon.cli", "--addr", addr, *args]
    print(f"$ ds3dctl {' '.join(args)}", flush=True)
    proc = subprocess.run(cmd, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"ds3dctl {args[0]} failed with exit code {proc.returncode}")
    return proc


def _start_object_store(state: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """moto_server on a free loopback port with the demo bucket; returns it and the
    environment that points boto3 (and so ds3dd and its workers) at it."""
    import boto3

    exe = Path(sys.executable).parent / "moto_server"
    if not exe.exists():
        raise SystemExit(f"moto_server is not installed next to {sys.executable}: run `make "
                         "setup` (installs moto[server]), or use --store file")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(state / "object-store.log", "ab") as out:
        proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **DEMO_KEYS})
    env = {**DEMO_KEYS, "AWS_ENDPOINT_URL": url}
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"the local object store did not start; see "
                                 f"{state / 'object-store.log'}") from None
            time.sleep(0.1)
    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                      aws_access_key_id=DEMO_KEYS["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=DEMO_KEYS["AWS_SECRET_ACCESS_KEY"])
    s3.create_bucket(Bucket=BUCKET)
    print(f"local object store: {url} (moto_server), bucket {BUCKET}", flush=True)
    return proc, env


def _list_bucket(env: dict[str, str], name: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=f"jobs/{name}/") for o in page.get("Contents", [])]
    manifests = sorted(k for k in keys if k.endswith("/MANIFEST.json"))
    print(f"\ns3://{BUCKET}/jobs/{name}/: {len(keys)} objects; committed checkpoints "
          f"(manifests):", flush=True)
    for key in manifests:
        print(f"  s3://{BUCKET}/{key}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds3d.daemon.demo", description=__doc__)
    ap.add_argument("--state-dir", default=".ds3d", help="daemon state (default ./.ds3d)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fresh", action="store_true", help="delete the state dir first")
    ap.add_argument("--store", choices=["s3", "file"], default="s3",
                    help="s3: a local S3 object store (moto_server) [default]; file: the "
                    "embedded file store")
    args = ap.parse_args(argv)

    state = Path(args.state_dir).resolve()
    if args.fresh:
        shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True, exist_ok=True)
    sock = state / "ds3dd.sock"
    addr = f"unix:{sock}"
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    store, s3_env = (None, {}) if args.store == "file" else _start_object_store(state)
    env.update(s3_env)
    print(f"starting ds3dd (state {state}, log {state / 'ds3dd.log'})", flush=True)
    with open(state / "ds3dd.out", "ab") as out:
        daemon = subprocess.Popen([sys.executable, "-m", "ds3d.daemon.main", "--state-dir",
                                   str(state), "--listen", addr], stdout=out, stderr=out, env=env)
    try:
        for _ in range(300):
            if sock.exists():
                break
            if daemon.poll() is not None:
                raise SystemExit(f"ds3dd exited with {daemon.returncode}; see {state}/ds3dd.out")
            time.sleep(0.1)
        name = f"demo-{time.strftime('%H%M%S')}"
        where = [] if store is None else ["--store", f"s3://{BUCKET}/jobs"]
        _ctl(addr, "start", "tiny", "--name", name, "--tp", "2", "--pp", "2", "--dp", "1",
             "--steps", str(args.steps), "--set", "checkpoint.interval=10", *where)
        _ctl(addr, "events", name, "--follow")
        _ctl(addr, "status", name)
        _ctl(addr, "checkpoints", name)
        if store is not None:
            _list_bucket(s3_env, name)
        print(f"\njob folder: {state / 'jobs' / name}  (reports/, ckpt/, logs/"
              f"{', store/' if store is None else ''})")
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        if store is not None:
            store.terminate()
            store.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
