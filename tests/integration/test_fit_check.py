"""`ds3dctl start` refuses a job that will not fit the node its daemon reports, before anything
is created, naming the per-rank breakdown and the smallest layout that fits."""

import pytest

from test_daemon_support import DaemonProc, kill_job_processes


@pytest.mark.timeout(120)
def test_gpt10b_on_one_141gb_gpu_is_refused_with_the_layout_that_fits(tmp_path):
    d = DaemonProc(tmp_path / "state", args=["--report-gpu-memory", "141GB"])
    with d:
        sets = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "launch.nnodes=1",
                "launch.nproc_per_node=1"]
        r = d.ctl("start", "gpt10b", "--name", "big", *[a for s in sets for a in ("--set", s)])
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Traceback" not in r.stderr
        assert "job 'big' will not fit this node" in r.stderr
        assert "the node's GPUs have 131.3 GiB (reported by ds3dd --report-gpu-memory)" in r.stderr
        assert "the smallest layout that fits: TP " in r.stderr and "--set parallel.tp=" in r.stderr
        for part in ("weights (bf16)", "Adam moments (fp32)", "snapshot buffers (pinned on GPU"):
            assert part in r.stderr
        r = d.ctl("status", "big")
        assert r.returncode != 0  # nothing was created
    kill_job_processes(tmp_path / "state")


def test_ds3dd_refuses_a_malformed_reported_size(tmp_path):
    import subprocess

    d = DaemonProc(tmp_path / "state", args=["--report-gpu-memory", "lots"])
    r = subprocess.run(d.argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--report-gpu-memory 'lots'" in r.stderr
