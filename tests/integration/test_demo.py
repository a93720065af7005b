"""`make demo` (the README's first command) end to end: a local S3 store, ds3dd, the tiny preset
as TP 2 x PP 2 on CPU; it completes and its committed checkpoints are manifests in the bucket."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import psutil
import pytest

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(600)
def test_demo_trains_to_completion_with_checkpoints_in_the_local_object_store(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ds3d.daemon.demo", "--state-dir",
                           str(tmp_path / "state"), "--steps", "10"],
                          capture_output=True, text=True, timeout=540)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    store = re.search(r"local object store: http://127\.0\.0\.1:(\d+) \(moto_server\)", out)
    assert store, out
    assert re.search(r"demo-\d+\s+COMPLETED\s+10/10", out), out[-3000:]
    assert re.search(r"step 10\s+committed", out), out[-3000:]
    assert re.search(r"s3://ds3d-demo/jobs/demo-\d+/ckpt/step-00000010/MANIFEST\.json", out), \
        out[-3000:]
    # the daemon and the object store were stopped
    state = str(tmp_path / "state")
    assert not [p.pid for p in psutil.process_iter(["cmdline"])
                if state in " ".join(p.info["cmdline"] or [])]
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", int(store.group(1)))) != 0
