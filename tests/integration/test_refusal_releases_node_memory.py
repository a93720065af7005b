"""A refusal mid-run under plain torchrun (a token id outside the vocabulary, past the prefix that
validation scans) leaves no node memory in /dev/shm: the group is not restarted (EXIT_CONFIG),
so nothing would read it. Was: ds3d-ID/rank-00000.arena stayed until the machine rebooted."""

import shutil
import subprocess
import sys

import numpy as np
import pytest

from ds3d.checkpoints.node_memory import default_root
from ds3d.trainer.token_scan import SCAN_TOKENS

from support import worker_env


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_refusal_mid_run_removes_the_node_memory_files(tmp_path):
    tokens = np.resize(np.arange(200, dtype=np.uint16), SCAN_TOKENS + (SCAN_TOKENS >> 2))
    tokens[SCAN_TOKENS:] = 300  # a fifth of the samples reach it; validation sees none
    tokens.tofile(tmp_path / "tokens.bin")
    (tmp_path / "job.toml").write_text(
        f'preset = "tiny"\nname = "refused"\n[data]\nsource = "{tmp_path / "tokens.bin"}"\n'
        "[checkpoint]\nkeep_in_node_memory = true\ninterval = 1\n")
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         "-m", "ds3d.trainer.worker", "--run-dir", str(run), "--config",
         str(tmp_path / "job.toml")],
        env=worker_env(), capture_output=True, text=True, timeout=240, check=False)
    shm = default_root() / f"ds3d-{(run / 'job_id').read_text().strip()}"  # the tests' own root
    try:
        assert f"{shm}/rank-00000.arena" in proc.stdout + proc.stderr  # it did hold some
        assert "token id 300 in the data file is outside model.vocab_size=256" in proc.stderr
        assert not shm.exists(), sorted(p.name for p in shm.iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
