"""The workers' MASTER_PORT under ds3d's real node agent (daemon/agent.py's `_install_hooks`,
daemon/ports.py): drawn outside the kernel's ephemeral port range at every rendezvous, the first
group's and the restarted group's, and bound by global rank 0's real TCPStore (a gloo process
group over env://) while the agent holds it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds3d.daemon.launcher import AgentSpec
from ds3d.daemon.ports import FIRST_PORT, PortRules, hold_port

from support import worker_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# A stand-in worker: a real gloo group through MASTER_ADDR/MASTER_PORT (rank 0 binds the
# TCPStore on it), one all-reduce, a record of what it was given; rank 1 of the first group
# then fails, so the agent runs the rendezvous again and a second MASTER_PORT is chosen.
PORT_WORKER = r'''
import json, os, sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
total = torch.ones(1)
dist.all_reduce(total)
(run_dir / f"rank{rank}-restart{restart}.json").write_text(json.dumps({
    "master_addr": os.environ["MASTER_ADDR"], "master_port": int(os.environ["MASTER_PORT"]),
    "world": int(total.item())}))
dist.destroy_process_group()
if restart == 0 and rank == 1:
    sys.exit(3)
'''


def test_master_port_is_outside_the_ephemeral_range_at_every_rendezvous(tmp_path: Path):
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "ds3d_port_worker.py").write_text(PORT_WORKER)
    run_dir = tmp_path / "run"
    (run_dir / "control").mkdir(parents=True)
    spec_file = run_dir / "control" / "agent.json"
    with hold_port() as rendezvous:
        AgentSpec.standalone(run_dir, 2, rendezvous.port, max_restarts=1, name="agent") \
            .model_copy(update={"worker_module": "ds3d_port_worker"}).write(spec_file)
        proc = subprocess.run([sys.executable, "-m", "ds3d.daemon.agent", "--spec",
                               str(spec_file)],
                              env=worker_env(PYTHONPATH=str(modules), DS3D_RUN_DIR=str(run_dir)),
                              capture_output=True, text=True, timeout=240)
    logs = "".join(f.read_text(errors="replace")
                   for f in sorted((run_dir / "logs").glob("**/std*.log")))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs[-3000:]
    first, last = PortRules.of_host().ephemeral
    reserved = PortRules.of_host().reserved
    records = {f.stem: json.loads(f.read_text()) for f in run_dir.glob("rank*-restart*.json")}
    assert sorted(records) == ["rank0-restart0", "rank0-restart1", "rank1-restart0",
                               "rank1-restart1"], proc.stderr[-3000:]
    for restart in (0, 1):
        group = [records[f"rank{rank}-restart{restart}"] for rank in (0, 1)]
        assert group[0] == group[1] and group[0]["world"] == 2
        port = group[0]["master_port"]
        assert FIRST_PORT <= port and not first <= port <= last, (restart, port, first, last)
        assert port not in reserved and port != rendezvous.port
        assert group[0]["master_addr"] == "127.0.0.1"
