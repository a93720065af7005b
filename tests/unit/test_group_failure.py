"""Which rank a failed worker group began with (daemon/agent.py `GroupFailure`, `FailureLog`):
torch elastic names the first failed process in local-rank order, so a rank killed by SIGKILL
was reported as rank 0's "Connection closed by peer". Pure cases from the probe's exit table,
then four real gloo ranks under torch elastic's own MultiprocessContext, one of them SIGKILLed,
polled as the agent's monitor loop polls them."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ds3d.daemon.agent import FailureLog, RankExit, failure_result, group_failure

PEER_ERROR = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
              "Connection closed by peer [127.0.0.1]:41234")


def test_a_killed_rank_is_the_culprit_not_rank_0_that_lost_it():
    t = 1000.0
    exits = [RankExit(0, 1, PEER_ERROR, 1000.0, t), RankExit(1, 1, PEER_ERROR, 1000.0, t),
             RankExit(2, -9, "", None, t), RankExit(3, 1, PEER_ERROR, 1000.0, t)]
    g = group_failure(exits)
    assert g.culprit is not None and g.culprit.rank == 2 and g.own
    assert [e.rank for e in g.after] == [0, 1, 3] and g.ended == []
    s = g.sentence()
    assert s.startswith("rank 2 failed first: killed by SIGKILL (signal 9)"), s
    assert "ranks [0, 1, 3] failed after it (exited with code 1: RuntimeError" in s
    assert "a consequence" in s and "exit codes by rank {0: 1, 1: 1, 2: -9, 3: 1}" in s
    rec = g.as_record(restarted=True)
    assert rec["rank"] == 2 and rec["signal"] == "SIGKILL" and rec["restarted"] is True


def test_ranks_the_agent_ended_are_not_blamed_and_a_real_error_beats_a_lost_peer():
    exits = [RankExit(0, -15, by_agent=True), RankExit(1, 1, PEER_ERROR, 1001.0, 5.0),
             RankExit(3, 1, "ValueError: odd bytes in the batch", 1001.0, 5.0)]
    g = group_failure(exits)
    assert g.culprit is not None and g.culprit.rank == 3 and g.own
    assert [e.rank for e in g.ended] == [0] and "rank 0 ended by the agent" in g.sentence()
    # found dead at an earlier poll than another failing on its own: the earlier one
    exits = [RankExit(0, 1, "ValueError: later", None, 9.0), RankExit(1, -6, "", None, 8.5)]
    assert group_failure(exits).culprit.rank == 1  # type: ignore[union-attr]


def test_only_lost_peers_on_this_node_says_so():
    g = group_failure([RankExit(4, 1, PEER_ERROR, 7.0, 2.0), RankExit(5, -15, by_agent=True)])
    assert g.culprit is not None and g.culprit.rank == 4 and not g.own
    assert g.sentence().startswith("no rank on this node failed on its own: rank 4 lost a peer")


def test_the_agents_exit_error_names_the_culprit_from_torchs_failures(tmp_path):
    """Without the agent's own table (torch's ProcessFailures alone) the killed rank is still
    named first, beside torch's choice."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {0: ProcessFailure(local_rank=0, pid=10, exitcode=1,
                                  error_file=str(_error_file(tmp_path, 0))),
                2: ProcessFailure(local_rank=2, pid=12, exitcode=-9, error_file="")}
    code, error = failure_result(failures)
    assert code == 1 and error.startswith("worker group failed: rank 2 failed first: killed by "
                                          "SIGKILL (signal 9); rank 0 failed after it"), error


def _error_file(folder: Path, rank: int) -> Path:
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    path = folder / f"error-{rank}.json"
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
    try:
        try:
            raise RuntimeError(PEER_ERROR.split(": ", 1)[1])
        except RuntimeError as e:
            ErrorHandler().record_exception(e)
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]
    return path


def _worker(rank: int, port: int, victim: int) -> None:
    """One rank of a 4-rank gloo group: all-reduces until `victim` SIGKILLs itself."""
    import torch
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main() -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=4)
        t = torch.ones(1 << 16)
        for step in range(100_000):
            if rank == victim and step == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(t)
            t.fill_(1.0)

    main()


@pytest.mark.timeout(120)
def test_a_sigkilled_rank_of_a_real_gloo_group_is_named_with_its_signal(tmp_path):
    """Four ranks all-reducing under torch elastic's MultiprocessContext; rank 2 SIGKILLs
    itself; the others die of "Connection closed by peer". Polled as LocalElasticAgent's
    monitor loop does (every 0.5 s; FailureLog.watch before torch's poll), the failure names
    rank 2 and SIGKILL, and is appended to the faults file."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    from ds3d.daemon.ports import hold_port

    with hold_port() as held:
        port = held.port
    logs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.ALL)
    pc = start_processes("w", _worker, {r: (r, port, 2) for r in range(4)},
                         {r: {} for r in range(4)}, logs, start_method="fork")
    group = SimpleNamespace(workers=[SimpleNamespace(global_rank=r) for r in range(4)])
    log = FailureLog(tmp_path / "agent-1.faults")
    result: Any = None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        log.watch(pc, group)
        result = pc.wait(0)
        if result is not None:
            break
        time.sleep(0.5)
    assert result is not None and result.is_failed()
    failure = log.failed(pc, group, result.failures, restarted=True)
    assert failure.culprit is not None and failure.culprit.rank == 2 and failure.own
    assert failure.sentence().startswith("rank 2 failed first: killed by SIGKILL (signal 9)")
    line = json.loads((tmp_path / "agent-1.faults").read_text().splitlines()[0])
    assert line["rank"] == 2 and line["signal"] == "SIGKILL" and line["restarted"] is True
    # torch's own report names whichever failed process it met first; the agent's exit error
    # follows the agent's reading of every rank
    code, error = failure_result(result.failures, log.last)
    assert code == 1 and "rank 2 failed first: killed by SIGKILL" in error


def test_an_agent_restart_is_a_fault_event_before_its_recovery_event(tmp_path):
    """The agent restarted the group after rank 2 was SIGKILLed: the daemon stores a
    worker_exit fault naming rank 2 and SIGKILL, ahead of the `recovery` event the restarted
    group's rank-0 `start` makes (both read in one supervisor pass, in the tick's order), once
    (a second pass, or a daemon restarted on the same store, records nothing again); the
    failure the agent did not restart from is left to its exit (agent_exit)."""
    from ds3d.daemon.agent import FAULTS_SUFFIX
    from ds3d.daemon.group_failures import GroupFailures
    from ds3d.daemon.jobdir import JobDir
    from ds3d.daemon.logging import get_logger
    from ds3d.daemon.metrics import Metrics
    from ds3d.daemon.reports import ReportTail
    from ds3d.daemon.store import Store
    from ds3d.trainer.config import build_job_config
    from ds3d.trainer.report import Reporter

    store = Store(tmp_path / "ds3d.db")
    jobdir = JobDir(tmp_path / "jobs", "j")
    (jobdir.path / "control").mkdir(parents=True)
    store.create_job("j", build_job_config("tiny", name="j").dump_json(), "n1", str(jobdir.path))
    attempt = store.get_job("j").attempt
    failures = GroupFailures(store, Metrics(), "j", jobdir, get_logger("test"))
    t = 1000.0
    killed = group_failure([RankExit(0, 1, PEER_ERROR, t, t), RankExit(1, 1, PEER_ERROR, t, t),
                            RankExit(2, -9, "", None, t), RankExit(3, 1, PEER_ERROR, t, t)])
    faults = jobdir.path / "control" / f"agent-{attempt}{FAULTS_SUFFIX}"
    faults.write_text(json.dumps(killed.as_record(restarted=True)) + "\n")
    Reporter(jobdir.path, 0, restart=1).emit("start", step=0, world_size=4)

    failures.record(store.get_job("j"))  # the supervisor's tick's order
    ReportTail(store, jobdir).poll()
    failures.record(store.get_job("j"))  # nothing new
    GroupFailures(store, Metrics(), "j", jobdir, get_logger("test")).record(  # a new daemon
        store.get_job("j"))
    events = [e for e in store.events(job="j") if e.kind in ("fault", "recovery")]
    assert [(e.kind, e.cause) for e in events] == [("fault", "worker_exit"),
                                                   ("recovery", "worker_exit")]
    fault = events[0]
    assert fault.rank == 2 and "rank 2 failed first: killed by SIGKILL (signal 9)" in \
        fault.message and "the agent restarts the group" in fault.message

    with faults.open("a") as fh:  # the budget is spent: the agent exits with this as its error
        fh.write(json.dumps(killed.as_record(restarted=False)) + "\n")
    failures.record(store.get_job("j"))
    assert len([e for e in store.events(job="j") if e.kind == "fault"]) == 1
    with faults.open("a") as fh:  # a damaged line is passed over, not an error in every tick
        fh.write(json.dumps({**killed.as_record(restarted=True), "rank": "two"}) + "\n")
    failures.record(store.get_job("j"))
    assert len([e for e in store.events(job="j") if e.kind == "fault"]) == 1


def test_a_rank_that_failed_on_another_node_is_named_with_that_node(tmp_path):
    """In a multi-node job the head pulls each other node's agent faults file into
    reports/nodes/<address>/ (daemon/multinode.py): the fault event names the rank that failed
    first there, and that node (its --node-name as it answered the pull), once."""
    from ds3d.daemon.agent import FAULTS_SUFFIX
    from ds3d.daemon.group_failures import GroupFailures
    from ds3d.daemon.jobdir import JobDir
    from ds3d.daemon.logging import get_logger
    from ds3d.daemon.metrics import Metrics
    from ds3d.daemon.multinode import NODE_NAME_FILE
    from ds3d.daemon.store import Store
    from ds3d.trainer.config import build_job_config

    store = Store(tmp_path / "ds3d.db")
    jobdir = JobDir(tmp_path / "jobs", "j")
    (jobdir.path / "control").mkdir(parents=True)
    store.create_job("j", build_job_config("tiny", name="j").dump_json(), "node-a",
                     str(jobdir.path))
    attempt = store.get_job("j").attempt
    failures = GroupFailures(store, Metrics(), "j", jobdir, get_logger("test"))
    t = 1000.0
    mirror = jobdir.reports / "nodes" / "127.0.0.1_7001"
    mirror.mkdir(parents=True)
    (mirror / NODE_NAME_FILE).write_text("node-b")
    killed = group_failure([RankExit(2, -9, "", None, t), RankExit(3, 1, PEER_ERROR, t, t)])
    (mirror / f"agent-{attempt}{FAULTS_SUFFIX}").write_text(
        json.dumps(killed.as_record(restarted=True)) + "\n")
    (mirror / f"agent-{attempt + 1}{FAULTS_SUFFIX}").write_text(  # another attempt's: not yet
        json.dumps(killed.as_record(restarted=True)) + "\n")

    failures.record(store.get_job("j"))
    failures.record(store.get_job("j"))  # nothing new
    [fault] = [e for e in store.events(job="j") if e.kind == "fault"]
    assert fault.cause == "worker_exit" and fault.rank == 2 and fault.node == "node-b"
    assert fault.message.startswith("worker group failed after step 0 on node node-b: rank 2 "
                                    "failed first: killed by SIGKILL (signal 9)"), fault.message
    assert fault.detail["node"] == "node-b" and fault.detail["signal"] == "SIGKILL"
