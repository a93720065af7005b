"""The node agent process: torch.distributed.elastic running this node's share of the workers.

Started by launcher.py as `python -m ds3d.daemon.agent --spec SPEC.json` in a session of its own,
so that SIGKILL of ds3dd does not take the training with it. It runs `elastic_launch` with a c10d
rendezvous on the job's store process (rendezvous.py), or torch elastic's etcd rendezvous
("etcd-v2") when the job sets `launch.rendezvous`, and the worker entry
`ds3d.trainer.worker --run-dir RUN_DIR` (forked, see below); the agent restarts a failed worker
group up to `max_restarts` times by itself.

Two hooks on torch elastic's `LocalElasticAgent` (`Ds3dAgent`; its restart loop is not copied):

* before each start of the group, the job's own TORCH_EXTENSIONS_DIR is made usable: build locks
  no live process holds are cleared and the warm cache's built ops copied in
  (daemon/extension_cache.py): a worker killed while DeepSpeed built its op blocks nothing;
  after it, the named semaphores the start made are recorded beside the pid file
  (daemon/semaphores.py), so that ds3dd can unlink them if the whole group is SIGKILLed;
* a group in which a worker exited with EXIT_CONFIG (trainer/exit_codes.py: its configuration was
  refused) is not restarted: the same configuration would be refused again.

and one on its rendezvous: the workers' MASTER_PORT is drawn outside the kernel's ephemeral port
range and held by the agent while global rank 0 binds it (daemon/ports.py), so no bind(0) on the
host can take it first. All three are installed by `_install_hooks`. Before its first rendezvous
the agent of a multi-node job waits for the agents of the other nodes started this attempt
(daemon/arrivals.py), so that a late one does not miss the round.

Workers are forked, not exec'd: the agent runs its entry as a function under torch elastic's
multiprocessing context with the "forkserver" start method, and the forkserver imports torch,
DeepSpeed and the trainer once (TRAINER_PRELOAD). A worker (re)start then costs a fork instead of
~4 CPU-seconds of imports per rank (on a 2-core machine a 4-rank group started in ~10 s); no
CUDA is touched before the fork. The forkserver is started first thing, so that its imports
overlap the agent's rendezvous (a worker's first start came 1.2 s sooner on CPU). On a node with
few CPUs it is a fork of the agent once it has imported torch (daemon/forked_forkserver.py):
torch is imported once per agent start, not twice; with PARALLEL_IMPORT_CPUS or more it is a new
interpreter importing beside the agent, which is sooner there.
Each worker sets its process title (daemon/procs.py WorkerTitle) so that `ps` and the daemon
still see which job and rank it is.

The workers' errors come from torch elastic's error files (the worker's `@record`), not from
their stderr. On its way out the agent writes `control/agent-<attempt>.exit` (JSON: exit_code,
error) atomically: after a daemon restart the agent is no longer the daemon's child, so its exit
status can only be learned from that file. No file means the agent itself was killed.

Which rank a failure began with (`GroupFailure`): torch elastic reports one ProcessFailure per
poll, the first failed process in local-rank order, so a rank killed by SIGKILL was reported as
rank 0's "Connection closed by peer" (its peers die of its death within milliseconds, all before
the next poll). The agent therefore notes, on every poll, which workers are already dead and
when, and once the group failed reads every rank's exit code and error file: the first rank that
failed on its own (killed by a signal the agent did not send, or an error that is not a lost
peer) is the culprit, the ranks that lost their connection to it failed after it, the rest were
ended by the agent. Each failure is appended to `control/agent-<attempt>.faults` (JSON lines,
`restarted` telling whether the agent restarted the group from it) before the group is
restarted, so the daemon records its `fault` event ahead of the new group's `start`; the last
one is the agent's exit error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds3d.trainer.exit_codes import EXIT_CONFIG

from .launcher import WORKER_MODULE, AgentSpec
from .procs import exit_without_teardown


def write_result(path: Path, exit_code: int, error: str = "") -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"exit_code": exit_code, "error": error, "time": time.time()}))
    os.replace(tmp, path)


def _write_pid_file(path: Path) -> None:
    """pid + start time of this agent, written first thing: a daemon that died between starting
    the agent and recording it finds the agent here (launcher.find)."""
    import psutil

    me = psutil.Process()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": me.pid, "started": me.create_time()}))
    os.replace(tmp, path)


def _agent_class(extensions: tuple[Path, Path] | None, semaphores: Path,
                 failures: FailureLog | None = None) -> type:
    """LocalElasticAgent with ds3d's two hooks (see the module docstring); `extensions` is
    (the job's TORCH_EXTENSIONS_DIR, the warm cache it is seeded from), `semaphores` the
    record of the named semaphores the group starts make, `failures` where each failed group
    is described (which rank failed first, and how)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from . import semaphores as named_semaphores
    from .extension_cache import prepare

    class Ds3dAgent(LocalElasticAgent):
        def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
            if extensions is not None:
                cleared, copied = prepare(*extensions)
                for lock in cleared:  # its holder is dead; its builders, if any, were ended
                    print(f"ds3d agent: cleared stale build lock {lock.path} ({lock.age_s:.0f} s "
                          f"old" + (f"; ended the orphaned build processes "
                                    f"{list(lock.workers)})" if lock.workers else ")"),
                          flush=True)
                if copied:
                    print(f"ds3d agent: built ops {copied} copied from {extensions[1]}",
                          flush=True)
            # when the rendezvous ended and the forks were asked for (a restore's first
            # seconds: the agent's start, its rendezvous, the forkserver's imports)
            print(f"ds3d agent: starting the worker group at {time.time():.3f} "
                  f"({self._remaining_restarts} restart(s) left)", flush=True)
            started: dict[int, Any] = super()._start_workers(worker_group)
            try:
                named_semaphores.record(semaphores)
            except OSError as e:  # the group runs; only a cleanup after a SIGKILL is lost
                print(f"ds3d agent: named semaphores not recorded in {semaphores}: {e}",
                      flush=True)
            return started

        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            if failures is not None:
                failures.watch(self._pcontext, worker_group)  # before torch ends the others
            result: RunResult = super()._monitor_workers(worker_group)
            if result.state is not WorkerState.FAILED:
                return result
            if any(f.exitcode == EXIT_CONFIG for f in result.failures.values()):
                self._remaining_restarts = 0  # refused configuration: a restart cannot help
            if failures is not None:
                failures.failed(self._pcontext, worker_group, result.failures,
                                restarted=self._remaining_restarts > 0)
            return result

    return Ds3dAgent


def _install_hooks(extensions: tuple[Path, Path] | None, semaphores: Path,
                   failures: FailureLog | None = None) -> None:
    """ds3d's changes to torch elastic, all made here, before `elastic_launch` builds the agent
    (torch's own module-level names are swapped; nothing of its loops is copied):

    * `launcher.api.LocalElasticAgent`, the name `launch_agent` builds the agent from, becomes
      `Ds3dAgent` (`_agent_class`: the module docstring's two hooks);
    * `rendezvous.api.get_free_port`, which `RendezvousStoreInfo.build` calls on the
      rendezvous's rank 0 to choose the workers' MASTER_PORT when their store is not the
      agent's (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, launcher.py), becomes `_master_port`:
      torch's bind(0) + close leaves the port to any bind(0) on the host until global rank 0
      binds its TCPStore seconds later (EADDRINUSE, a group restart); ports.hold_port draws it
      outside the ephemeral range and holds it until the next rendezvous chooses again. The
      other nodes read it from the rendezvous store, and global rank 0 runs on the rank-0
      node, so the node that chooses is the node that binds.
    """
    import torch.distributed.elastic.rendezvous.api as rendezvous_api
    import torch.distributed.launcher.api as launcher_api

    from .ports import HeldPort, hold_port

    held: list[HeldPort] = []

    def _master_port() -> int:
        while held:
            held.pop().close()  # the previous group's port: its workers are gone
        held.append(hold_port())
        return held[0].port

    if not hasattr(rendezvous_api, "get_free_port"):
        print("ds3d agent: torch.distributed.elastic.rendezvous.api has no get_free_port: "
              "MASTER_PORT is chosen by torch, outside ds3d's rule (daemon/ports.py)",
              flush=True)
    setattr(rendezvous_api, "get_free_port", _master_port)  # noqa: B010
    setattr(launcher_api, "LocalElasticAgent",  # noqa: B010
            _agent_class(extensions, semaphores, failures))


def run(spec: AgentSpec) -> tuple[int, str]:
    from .extension_cache import warm_root
    from .semaphores import RECORD_SUFFIX

    extensions = None
    if spec.extensions_dir:
        extensions = (Path(spec.extensions_dir), warm_root(spec.warm_extensions_dir))
        # the workers inherit it from the forkserver, which is started next
        os.environ["TORCH_EXTENSIONS_DIR"] = spec.extensions_dir
    module = spec.worker_module
    _start_forkserver(list(TRAINER_PRELOAD) if module == WORKER_MODULE else [])
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    failures = FailureLog(Path(spec.result_file).with_suffix(FAULTS_SUFFIX))
    _install_hooks(extensions, Path(spec.pid_file).with_suffix(RECORD_SUFFIX), failures)
    if spec.max_nodes > 1:
        _meet_the_other_agents(spec)
    config = LaunchConfig(
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        nproc_per_node=spec.nproc_per_node,
        run_id=spec.run_id,
        role="ds3d",
        rdzv_backend=spec.rdzv_backend,
        rdzv_endpoint=spec.rdzv_endpoint,
        rdzv_configs=dict(spec.rdzv_configs),
        max_restarts=spec.max_restarts,
        monitor_interval=spec.monitor_interval,
        start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=spec.log_dir, redirects=Std.ALL),
        local_addr=spec.local_addr,
    )
    try:
        elastic_launch(config, run_module_as_main)(module, spec.run_dir, *spec.worker_args)
    except ChildFailedError as e:
        return failure_result(e.failures, failures.last)
    return 0, ""


def _meet_the_other_agents(spec: AgentSpec) -> None:
    """Waits for the agents of every node started this attempt (arrivals.py) so that none
    misses the rendezvous's first round. A store that cannot be reached is left to the
    rendezvous, which reports it with torch's own error."""
    from .arrivals import meet, rendezvous_store

    try:
        store = rendezvous_store(spec.rdzv_backend, spec.rdzv_endpoint, spec.run_id,
                                 spec.min_nodes, spec.max_nodes, dict(spec.rdzv_configs))
        arrived, expected, waited = meet(store, spec.run_id, spec.expected_nodes)
    except Exception as e:  # noqa: BLE001 - the rendezvous itself reports the store's trouble
        print(f"ds3d agent: no arrival check before the rendezvous ({type(e).__name__}: {e})",
              flush=True)
        return
    complete = expected is not None and arrived >= expected
    print(f"ds3d agent: {arrived} of {expected if expected is not None else '?'} nodes' agents "
          f"arrived after {waited:.1f} s" + ("" if complete else
          ": the rendezvous forms without the others (min_nodes)"), flush=True)


# Imported by the forkserver before any worker is forked: everything the trainer imports that
# costs time (torch, torch._dynamo, which torch.optim imports on first use, and DeepSpeed), then
# trainer/preload.py (warm caches, gc.freeze), last. None of it initialises CUDA: a forked child
# could not use it then.
TRAINER_PRELOAD = ("torch", "torch._dynamo", "ds3d.trainer.worker", "ds3d.trainer.loop",
                   "ds3d.daemon.agent", "ds3d.trainer.preload")


# A node with at least this many CPUs starts the forkserver as a new interpreter before the agent
# imports torch: both import it at once, which costs a second import's CPU but no time there (on
# an H100 host the worker of a restore was forked 1.1 s sooner: 2.4-2.7 -> 1.0-1.6 s after the
# group start). A smaller node (CI's 2 cores) forks the server once torch is imported, sparing
# that CPU.
PARALLEL_IMPORT_CPUS = 8


def _start_forkserver(preload: list[str]) -> None:
    """Starts the forkserver now, with what it imports once for every worker it forks (a
    stand-in worker module is not preloaded: importing it runs it), so that its imports
    (~5-8 s of torch, DeepSpeed and the trainer) overlap the agent's rendezvous instead of
    following it: torch elastic's "forkserver" start method uses this same server once the group
    starts (multiprocessing's one forkserver per process). On a node with few CPUs the server
    is a fork of the agent once the agent has imported torch, which it needs anyway
    (forked_forkserver.py): a fresh interpreter would import torch a second time; with
    PARALLEL_IMPORT_CPUS or more it is that fresh interpreter, importing beside the agent."""
    from .forked_forkserver import start, start_exec

    if (os.cpu_count() or 1) >= PARALLEL_IMPORT_CPUS:
        start_exec(preload)
        return
    import torch  # noqa: F401 - imported before the fork, for the server too

    if not start(preload):
        print("ds3d agent: the forkserver was started as a new interpreter (this process "
              "runs threads)", flush=True)


def run_module_as_main(module: str, run_dir: str, *args: str) -> None:
    """A worker: `python -m MODULE --run-dir RUN_DIR ARGS...`, run in the process the forkserver
    forked (torch elastic has set RANK, LOCAL_RANK... in its environment by now)."""
    import runpy

    import setproctitle

    from .procs import WorkerTitle

    setproctitle.setproctitle(str(WorkerTitle(module, run_dir, int(os.environ["RANK"]),
                                              int(os.environ["LOCAL_RANK"]))))
    sys.argv = [module, "--run-dir", run_dir, *args]
    with warnings.catch_warnings():
        # run as `python -m` would, though the forkserver preloaded the module: expected here
        warnings.filterwarnings("ignore", message=r".* found in sys\.modules after import",
                                category=RuntimeWarning)
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def failure_result(failures: dict[int, Any],
                   described: GroupFailure | None = None) -> tuple[int, str]:
    """(exit code, error) of the agent for a failed group, from torch elastic's ProcessFailures
    (their `message` is the worker's error file, written by `@record`, or the signal that ended
    it), or from `described`, the agent's own reading of every rank of that group (FailureLog:
    torch names one rank, not necessarily the one that failed first). EXIT_CONFIG is passed on
    when a rank refused the configuration and the others were only ended by the agent (a
    negative code), so that the daemon does not restart it."""
    codes = {rank: f.exitcode for rank, f in failures.items()}
    print(f"ds3d agent: worker group failed: exit codes by rank {codes}", flush=True)
    errors = {rank: _message(f) for rank, f in failures.items() if f.exitcode > 0}
    if any(c == EXIT_CONFIG for c in codes.values()) and \
            all(c == EXIT_CONFIG or c < 0 for c in codes.values()):
        refused = min(r for r, c in codes.items() if c == EXIT_CONFIG)
        return EXIT_CONFIG, errors.get(refused) or \
            f"worker configuration refused (exit code {EXIT_CONFIG})"
    if described is None or not set(codes) <= {e.rank for e in described.exits}:
        described = group_failure([RankExit.of(rank, f) for rank, f in failures.items()])
    return 1, f"worker group failed: {described.sentence()}"


# The errors of a rank that failed because a peer did: its collective's or the store's
# connection to the dead rank broke (gloo, NCCL, the c10d store). Such a rank is not where the
# failure began.
PEER_LOST = re.compile(
    r"closed by peer|reset by peer|broken pipe|connection refused|connection reset|"
    r"remote process exited|communicator was aborted|ECONNRESET|EPIPE|"
    r"peer (?:process|rank)? ?\S* ?(?:exited|died|closed|disconnected)", re.IGNORECASE)

ERROR_CHARS = 300  # of one rank's error in a sentence; the whole is in the error file
FAULTS_SUFFIX = ".faults"  # control/agent-<attempt>.faults, beside the .exit file


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class RankExit:
    """How one rank of a failed group ended."""

    rank: int                # global rank
    exit_code: int           # negative: killed by that signal
    error: str = ""          # its error file's "Type: text" (`@record`), "" without one
    error_time: float | None = None  # when it wrote that file (torch keeps whole seconds)
    seen_dead_at: float | None = None  # when the agent found it dead before ending the group
    by_agent: bool = False   # still running when the group failed: ended by the agent

    @classmethod
    def of(cls, rank: int, failure: Any, seen_dead_at: float | None = None,
           by_agent: bool = False) -> RankExit:
        """From a torch elastic ProcessFailure (which read the rank's error file, if any)."""
        has_file = os.path.isfile(str(getattr(failure, "error_file", "")))
        return cls(rank, int(failure.exitcode), _message(failure) if has_file else "",
                   float(failure.timestamp) if has_file else None, seen_dead_at, by_agent)

    @property
    def signal(self) -> int:
        return -self.exit_code if self.exit_code < 0 else 0

    @property
    def lost_a_peer(self) -> bool:
        """It failed because its connection to another rank broke (a consequence)."""
        return self.exit_code > 0 and bool(PEER_LOST.search(self.error))

    def how(self) -> str:
        if self.signal:
            return f"killed by {_signal_name(self.signal)} (signal {self.signal})"
        error = self.error if len(self.error) <= ERROR_CHARS else \
            self.error[:ERROR_CHARS] + " ..."
        return f"exited with code {self.exit_code}" + (f": {error}" if error else "")

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "exit_code": self.exit_code,
                "signal": _signal_name(self.signal) if self.signal else "",
                "error": self.error, "error_time": self.error_time,
                "seen_dead_at": self.seen_dead_at, "ended_by_agent": self.by_agent}


@dataclass(frozen=True)
class GroupFailure:
    """A failed group read rank by rank: the culprit (the first rank that failed on its own),
    the ranks that failed after it and those the agent ended."""

    exits: list[RankExit]
    culprit: RankExit | None
    own: bool  # the culprit failed on its own (False: every rank here only lost a peer)
    after: list[RankExit] = field(default_factory=list)
    ended: list[RankExit] = field(default_factory=list)

    def sentence(self) -> str:
        codes = {e.rank: e.exit_code for e in sorted(self.exits, key=lambda e: e.rank)}
        parts = []
        c = self.culprit
        if c is not None and self.own:
            parts.append(f"rank {c.rank} failed first: {c.how()}")
        elif c is not None:
            parts.append(f"no rank on this node failed on its own: rank {c.rank} lost a peer "
                         f"first ({c.how()}); the rank that failed is on another node or its "
                         "process left without an exit status here")
        kinds: dict[str, list[int]] = {}
        for e in self.after:
            kinds.setdefault(e.how(), []).append(e.rank)
        for how, ranks in kinds.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
            lost = all(e.lost_a_peer for e in self.after if e.rank in ranks)
            parts.append(f"{who} failed after it ({how}" + (
                ": a consequence, its collectives lost the failed rank)" if lost else ")"))
        if self.ended:
            ranks = [e.rank for e in self.ended]
            parts.append((f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}") +
                         " ended by the agent")
        parts.append(f"exit codes by rank {codes}")
        return "; ".join(parts)

    def as_record(self, restarted: bool) -> dict[str, Any]:
        """One line of control/agent-<attempt>.faults (read by the daemon's supervisor)."""
        c = self.culprit
        return {"time": time.time(), "restarted": restarted, "message": self.sentence(),
                "rank": c.rank if c is not None else -1, "own": self.own,
                "how": c.how() if c is not None else "",
                "exit_code": c.exit_code if c is not None else None,
                "signal": _signal_name(c.signal) if c is not None and c.signal else "",
                "after": [e.rank for e in self.after], "ended": [e.rank for e in self.ended],
                "ranks": [e.as_dict() for e in sorted(self.exits, key=lambda e: e.rank)]}


def group_failure(exits: list[RankExit]) -> GroupFailure:
    """Which rank the failure began with. Ranks ended by the agent are not candidates; among
    the others, those that failed on their own (a signal, or an error that is not a lost peer)
    before those that lost a peer; then the one found dead first, a signal before an error
    found at the same poll (a peer raises only once the dead rank's socket closed), the error
    file written first, the lowest rank."""
    def key(e: RankExit) -> tuple[float, int, float, int]:
        return (e.seen_dead_at if e.seen_dead_at is not None else math.inf,
                0 if e.signal else 1,
                e.error_time if e.error_time is not None else math.inf, e.rank)

    own = [e for e in exits if not e.by_agent and not e.lost_a_peer]
    lost = [e for e in exits if not e.by_agent and e.lost_a_peer]
    pool = own or lost or [e for e in exits if e.signal != signal.SIGTERM] or list(exits)
    culprit = min(pool, key=key) if pool else None
    after = sorted((e for e in exits if e is not culprit and not e.by_agent),
                   key=lambda e: e.rank)
    ended = sorted((e for e in exits if e is not culprit and e.by_agent), key=lambda e: e.rank)
    return GroupFailure(list(exits), culprit, bool(own), after, ended)


class FailureLog:
    """The agent's record of its group's failures: which workers it found dead on each poll
    (before torch's poll ends the others), and, once the group failed, every rank's exit
    (`GroupFailure`), appended to `path` before the group is restarted."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last: GroupFailure | None = None
        self._dead: dict[int, tuple[int, float]] = {}  # local rank -> (exit code, seen at)

    def watch(self, pcontext: Any, worker_group: Any) -> None:
        """Notes the workers that are already dead (before torch's poll, which ends the rest
        once one failed)."""
        now = time.time()
        for local_rank, proc in _processes(pcontext).items():
            code = _exitcode(proc)
            if code is not None and code != 0 and local_rank not in self._dead:
                self._dead[local_rank] = (int(code), now)

    def failed(self, pcontext: Any, worker_group: Any, reported: dict[int, Any],
               restarted: bool) -> GroupFailure:
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        exits: dict[int, RankExit] = {}
        error_files = getattr(pcontext, "error_files", {}) or {}
        for local_rank, proc in _processes(pcontext).items():
            code = _exitcode(proc)
            if code is None or code == 0:
                continue
            rank = int(worker_group.workers[local_rank].global_rank)
            seen = self._dead.get(local_rank)
            failure = ProcessFailure(local_rank=local_rank, pid=int(proc.pid or 0),
                                     exitcode=int(code),
                                     error_file=str(error_files.get(local_rank, "")))
            exits[rank] = RankExit.of(rank, failure, seen[1] if seen else None,
                                      by_agent=seen is None and int(code) < 0)
        for rank, f in reported.items():  # torch's own report, where the processes are not
            exits.setdefault(int(rank), RankExit.of(int(rank), f, time.time()))
        self._dead.clear()
        self.last = group_failure(list(exits.values()))
        record = self.last.as_record(restarted)
        print(f"ds3d agent: worker group failed: {record['message']}"
              + ("; restarting it" if restarted else ""), flush=True)
        try:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record, default=str) + "\n")
        except OSError as e:  # the group restarts anyway; only the daemon's fault event is lost
            print(f"ds3d agent: cannot record the failure in {self.path}: {e}", flush=True)
        return self.last


def _exitcode(proc: Any) -> int | None:
    """A worker process's exit code without waiting (None: running, or not known)."""
    try:
        code = proc.exitcode
    except (ValueError, OSError):  # a closed Process object
        return None
    return None if code is None else int(code)


def _processes(pcontext: Any) -> dict[int, Any]:
    """local rank -> multiprocessing.Process of torch elastic's MultiprocessContext (its `_pc`,
    a torch.multiprocessing.ProcessContext); {} for another kind of context."""
    pc = getattr(pcontext, "_pc", None)
    procs = getattr(pc, "processes", None)
    return dict(enumerate(procs)) if procs else {}


def _message(failure: Any) -> str:
    """The error of one ProcessFailure: its error file's message ("Type: text"), which torch
    keeps either as that string or as {"message": ..., "extraInfo": {...}}."""
    m = failure.message
    if isinstance(m, dict):
        m = m.get("message", "")
    return str(m or "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ds3d.daemon.agent")
    ap.add_argument("--spec", type=Path, required=True, help="agent spec JSON (launcher.py)")
    a = ap.parse_args(argv)
    spec = AgentSpec.read(a.spec)
    result = Path(spec.result_file)
    _write_pid_file(Path(spec.pid_file))
    code, error = 1, ""
    try:
        code, error = run(spec)
    except BaseException as e:  # noqa: BLE001 - recorded for the daemon, then re-raised
        error = f"{type(e).__name__}: {e}"
        write_result(result, 1 if not isinstance(e, SystemExit) else int(e.code or 0), error)
        raise
    write_result(result, code, error)
    exit_without_teardown(code)


def _run_as_imported_module() -> None:
    """`python -m ds3d.daemon.agent` runs this file as `__main__`; multiprocessing would then
    re-run it as `__mp_main__` in every worker the forkserver starts (and runpy warned that it
    was preloaded there already, once per worker). The agent runs from the module under its own
    name instead, whose functions the workers unpickle from the preloaded copy, and `__main__`
    is left nothing multiprocessing could re-run."""
    import importlib

    entry = sys.modules["__main__"]
    entry.__spec__ = None
    entry.__dict__.pop("__file__", None)
    importlib.import_module("ds3d.daemon.agent").main()


if __name__ == "__main__":
    _run_as_imported_module()
