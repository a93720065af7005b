"""ds3d's node agent on a GPU: its workers are forked from a forkserver that imported torch,
DeepSpeed and the trainer (daemon/agent.py TRAINER_PRELOAD). A CUDA context made before the fork
would be unusable in every worker, so this is where that shows: the forked workers must train on
CUDA with NCCL (one rank per visible GPU, up to 2), and a crash-restart forks a second group from
the same forkserver. Skipped on machines without CUDA (pytest -m gpu runs it there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fixtures.s3 import free_port
from support import records

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.timeout(400)
def test_agent_forks_cuda_workers_that_train_and_restart(tmp_path):
    import torch

    from ds3d.daemon.launcher import RDZV_CONFIGS, AgentSpec
    from ds3d.trainer.config import build_job_config

    nproc = min(2, torch.cuda.device_count())
    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    cfg = build_job_config("tiny", ['launch.device="cuda"', "train.steps=8", "train.warmup_steps=2",
                                    "checkpoint.interval=2", "parallel.tp=1", "parallel.pp=1",
                                    f"parallel.dp={nproc}"], name="forked")
    (run / "job.json").write_text(cfg.dump_json())
    # rank 0 crashes at step 5: the agent forks a second group, which resumes from a checkpoint
    (run / "control" / "inject.json").write_text(json.dumps(
        {"id": 1, "kind": "crash", "rank": 0, "at_step": 5}))
    AgentSpec(run_dir=str(run), run_id="forked", min_nodes=1, max_nodes=1, nproc_per_node=nproc,
              rdzv_endpoint=f"127.0.0.1:{free_port()}",
              rdzv_configs={**RDZV_CONFIGS, "is_host": True}, max_restarts=1,
              log_dir=str(run / "logs"), result_file=str(run / "control" / "agent.exit"),
              pid_file=str(run / "control" / "agent.pid")).write(run / "control" / "agent.json")
    env = dict(os.environ, DS_ACCELERATOR="cuda", NCCL_NVLS_ENABLE="0", DS3D_RUN_DIR=str(run),
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "ds3d.daemon.agent", "--spec",
                           str(run / "control" / "agent.json")], env=env, capture_output=True,
                          text=True, timeout=360)
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in run.glob("logs/**/std*.log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    starts = records(run, 0, "start")
    assert [s["device"] for s in starts] == ["cuda:0", "cuda:0"], starts  # two groups, on CUDA
    assert starts[1]["restart"] == 1 and starts[1]["step"] in (2, 4), starts
    assert {r["step"] for r in records(run, 0, "step")} == set(range(1, 9))
    assert records(run, 0, "done")[-1]["reason"] == "completed"
