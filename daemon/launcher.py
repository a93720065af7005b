"""Starting, finding again and stopping a node's elastic agent for a job.

The daemon never runs workers itself: it starts one agent process per job on this node (agent.py,
torch.distributed.elastic) in its own session and records the agent's pid and start time. After a
daemon restart `Launcher.attach` recognises a live agent by both (pid reuse safe); an agent that
is gone is reported with the exit code from its result file, or None if it was killed.

Environment the workers inherit through the agent:
* `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` — DeepSpeed fails to re-initialise after an elastic
  restart when the workers share the agent's rendezvous store (pytorch#135712); global rank 0
  then binds a store of its own on MASTER_PORT, which the agent draws outside the kernel's
  ephemeral port range and holds until the next rendezvous (daemon/ports.py, agent.py's
  `_install_hooks`), so no bind(0) on the host can take it before the worker binds it;
* `DS_ACCELERATOR=cpu` when the job's device is cpu (gloo backend);
* `NCCL_NVLS_ENABLE=0` always (NVLink multicast off: it needs fabric setup these hosts lack);
* `DS3D_RUN_DIR`, `DS3D_JOB`, `PYTHONUNBUFFERED=1`;
* `TORCH_EXTENSIONS_DIR=RUN_DIR/torch_extensions`: the job's own build folder for DeepSpeed's
  JIT-built ops, seeded by the agent from the daemon's warm cache (its TORCH_EXTENSIONS_DIR, else
  torch's default), so a worker killed while holding a build lock blocks no other job
  (extension_cache.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from pydantic import BaseModel, ConfigDict, Field

from ds3d.trainer.config import JobConfig

from .extension_cache import job_extensions_dir
from .logging import get_logger
from .procs import ProcessRef, job_workers, spawn_detached
from .rendezvous import ETCD_BACKEND

WORKER_MODULE = "ds3d.trainer.worker"
log = get_logger("ds3d.launcher")
AGENT_EXIT_GRACE_S = 5.0  # an agent alive this long after writing its result is killed

# c10d rendezvous tuned for fast re-rendezvous after a node loss (FIELD-NOTES: ~8.5 s instead of
# ~45 s); `is_host=False` because the store lives in its own process (rendezvous.py). A node whose
# heartbeat is older than interval x attempts is dropped, also from a round that has just formed:
# its peers then train without it, below min_nodes, while it waits for its ranks until a timeout
# (a stress run of 12-06: an agent starved of CPU for 2 s). 4 attempts tolerate such a stall; a
# dead node is dropped 2 s later than with 2 (the lost-node drill: noticed 8.0 -> 8.6 s).
RDZV_CONFIGS: dict[str, object] = {
    "is_host": False,
    "last_call_timeout": 5,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 4,
    "join_timeout": 600,
    "read_timeout": 60,
}
# the same dynamic rendezvous on etcd (launch.rendezvous): `is_host` is c10d's alone, and
# `read_timeout` becomes python-etcd's per-request timeout. A node whose heartbeat is older than
# interval x attempts is dropped from the rendezvous for good (its keep-alive then stops): each
# heartbeat is an HTTP read and compare-and-swap on one key all nodes write, so etcd gets more
# slack than the in-memory store before a slow node is taken for a dead one.
ETCD_RDZV_CONFIGS: dict[str, object] = {
    **{k: v for k, v in RDZV_CONFIGS.items() if k != "is_host"}, "keep_alive_max_attempt": 5}


class AgentSpec(BaseModel):
    """What one agent process is asked to run (agent.py reads it): written by `Launcher.start`
    as control/agent-<attempt>.json, or by a test that runs a job under the agent without a
    daemon. The one definition of the file's fields, checked strictly when the agent reads it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    run_dir: str
    run_id: str = Field(min_length=1)
    min_nodes: int = Field(ge=1)
    max_nodes: int = Field(ge=1)
    nproc_per_node: int = Field(ge=1)
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str
    rdzv_configs: dict[str, Any]
    max_restarts: int = Field(ge=0)
    monitor_interval: float = Field(default=0.5, gt=0)
    worker_module: str = WORKER_MODULE
    worker_args: list[str] = Field(default_factory=list, description="after --run-dir RUN_DIR")
    log_dir: str
    result_file: str
    pid_file: str
    local_addr: str | None = Field(default=None, description="torch elastic's local_addr (None: "
                                   "the host's FQDN)")
    extensions_dir: str | None = Field(default=None, description="the job's own "
                                       "TORCH_EXTENSIONS_DIR, seeded from warm_extensions_dir")
    warm_extensions_dir: str | None = None
    expected_nodes: int | None = Field(default=None, ge=1, description="the head's agent: the "
                                       "nodes started this attempt, whose agents it waits for "
                                       "before the rendezvous (arrivals.py); None elsewhere")

    @classmethod
    def standalone(cls, run_dir: Path, nproc_per_node: int, port: int, max_restarts: int,
                   name: str, worker_args: list[str] | None = None,
                   extensions_dir: str | None = None,
                   warm_extensions_dir: str | None = None) -> AgentSpec:
        """A one-node job without a daemon (a test or a benchmark), as `torchrun --standalone`:
        the agent hosts the c10d rendezvous on loopback `port`; its workers' logs go to
        RUN_DIR/logs/`name`, its exit code and pid to RUN_DIR/control/`name`-agent.exit/.pid."""
        control = run_dir / "control"
        return cls(run_dir=str(run_dir), run_id=run_dir.name, min_nodes=1, max_nodes=1,
                   nproc_per_node=nproc_per_node, rdzv_endpoint=f"127.0.0.1:{port}",
                   rdzv_configs={**RDZV_CONFIGS, "is_host": True}, max_restarts=max_restarts,
                   worker_args=worker_args or [], log_dir=str(run_dir / "logs" / name),
                   result_file=str(control / f"{name}-agent.exit"),
                   pid_file=str(control / f"{name}-agent.pid"), local_addr="127.0.0.1",
                   extensions_dir=extensions_dir, warm_extensions_dir=warm_extensions_dir)

    def write(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> AgentSpec:
        return cls.model_validate_json(path.read_bytes())


@dataclass
class AgentHandle:
    """A running (or finished) agent: its durable identity and, while this daemon started it,
    the Popen used to reap it and read its exit status."""

    ref: ProcessRef
    result_file: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def poll(self) -> int | None:
        """None while the agent runs; its exit code once it ended; -9 if it ended without a
        result file (killed, so no code could be recorded).

        The result file is the agent's verdict, written once its workers are gone: an agent
        still alive AGENT_EXIT_GRACE_S after it is stuck in its interpreter's teardown (seen
        for 15 s and more on a loaded 2-core machine, long enough for the hang detector to
        take the finished job for a hung one and restart it). Its process group is then
        killed and the recorded code returned."""
        running = self.popen.poll() is None if self.popen is not None else self.ref.alive()
        if running:
            try:
                written = self.result_file.stat().st_mtime
            except FileNotFoundError:
                return None
            if time.time() - written < AGENT_EXIT_GRACE_S:
                return None
            log.warning("agent_lingered", pid=self.ref.pid, after_result_s=round(
                time.time() - written, 1), detail="its result was written; killed")
            self.ref.terminate(grace_s=0)
            if self.popen is not None:
                self.popen.poll()
        try:
            return int(json.loads(self.result_file.read_text())["exit_code"])
        except (FileNotFoundError, ValueError, KeyError):
            return self.popen.returncode if self.popen is not None else -9


class Launcher:
    """Builds the agent spec from a JobConfig and starts/stops agent processes."""

    def __init__(self, worker_module: str = WORKER_MODULE, python: str = sys.executable,
                 node_addr: str | None = None) -> None:
        self.worker_module = worker_module
        self.python = python
        # the address other nodes reach this node's workers at (torch elastic's `local_addr`:
        # MASTER_ADDR when global rank 0 runs here); None lets torch use the FQDN
        self.node_addr = node_addr

    def start(self, run_dir: Path, cfg: JobConfig, attempt: int, rdzv_endpoint: str,
              run_id: str, local_addr: str | None = None,
              expected_nodes: int | None = None,
              restarts_left: int | None = None) -> AgentHandle:
        """Writes `control/agent-<attempt>.json` and starts the agent on it. The head passes
        `expected_nodes` (the nodes started this attempt, itself included) and `restarts_left`:
        what the job's restart budget has left (each agent restarts its group by itself, so
        one given the whole of `launch.max_restarts` at every relaunch or resume made the budget
        endless in effect; a share node's agent follows the head's rendezvous)."""
        nnodes = cfg.launch.nnodes
        nproc = cfg.launch.nproc_per_node or cfg.parallel.world_size // nnodes
        control = run_dir / "control"
        control.mkdir(parents=True, exist_ok=True)
        result_file = control / f"agent-{attempt}.exit"
        result_file.unlink(missing_ok=True)
        spec = AgentSpec(
            run_dir=str(run_dir), run_id=run_id, min_nodes=cfg.launch.min_nodes or nnodes,
            max_nodes=nnodes, nproc_per_node=nproc,
            rdzv_backend=ETCD_BACKEND if cfg.launch.rendezvous else "c10d",
            rdzv_endpoint=rdzv_endpoint,
            rdzv_configs=ETCD_RDZV_CONFIGS if cfg.launch.rendezvous else RDZV_CONFIGS,
            max_restarts=cfg.launch.max_restarts if restarts_left is None
            else max(0, restarts_left), worker_module=self.worker_module,
            log_dir=str(run_dir / "logs" / f"attempt-{attempt}"), result_file=str(result_file),
            pid_file=str(control / f"agent-{attempt}.pid"), local_addr=local_addr or self.node_addr,
            extensions_dir=str(job_extensions_dir(run_dir)),
            warm_extensions_dir=os.environ.get("TORCH_EXTENSIONS_DIR") or None,
            expected_nodes=expected_nodes if nnodes > 1 else None)
        spec_file = control / f"agent-{attempt}.json"
        spec.write(spec_file)
        env = dict(os.environ)
        env.update({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "DS3D_RUN_DIR": str(run_dir),
                    "DS3D_JOB": cfg.name, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0",
                    "TORCH_EXTENSIONS_DIR": str(job_extensions_dir(run_dir))})
        if cfg.launch.device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
            # intra-op threads share the node's cores among its workers (as torchrun does);
            # 4 workers x all cores each thrash a small machine
            per = max(1, (os.cpu_count() or 1) // max(1, nproc))
            env.setdefault("OMP_NUM_THREADS", str(per))
        popen, ref = spawn_detached(
            [self.python, "-m", "ds3d.daemon.agent", "--spec", str(spec_file)],
            run_dir / "logs" / "agent.log", env, run_dir)
        return AgentHandle(ref, result_file, popen)

    @staticmethod
    def find(run_dir: Path, attempt: int) -> AgentHandle | None:
        """The agent of `attempt` from the pid file it wrote itself (None if it never started):
        covers a daemon killed after starting an agent but before recording it."""
        try:
            d = json.loads((run_dir / "control" / f"agent-{attempt}.pid").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return Launcher.attach(run_dir, attempt, int(d["pid"]), float(d["started"]))

    @staticmethod
    def attach(run_dir: Path, attempt: int, pid: int, started: float) -> AgentHandle:
        """The agent of `attempt` as recorded before a daemon restart (alive or not)."""
        return AgentHandle(ProcessRef(pid, started),
                           run_dir / "control" / f"agent-{attempt}.exit")


def kill_strays(run_dir: Path, grace_s: float = 5.0) -> list[int]:
    """Ends worker processes of `run_dir` whose agent is gone.

    A worker outlives a SIGKILLed agent until its forkserver notices (and a worker that ignores
    the SIGINT it then gets lives on, still writing reports, still holding memory). Before a
    relaunch the daemon finds them by their process title (procs.WorkerTitle) and ends them:
    SIGTERM (and SIGCONT: a stopped worker would sit out the whole grace before it could act
    on it), then SIGKILL after `grace_s`. Returns the pids it signalled."""
    strays = list(job_workers(run_dir))
    for p in strays:
        try:
            p.terminate()
            p.resume()
        except psutil.NoSuchProcess:
            pass
    _gone, alive = psutil.wait_procs(strays, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in strays]
