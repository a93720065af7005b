"""The elastic agents' group failures as fault events, on the job's head node.

An agent that restarts its worker group by itself appends, before it does, one JSON line to
control/agent-<attempt>.faults naming the rank the failure began with and how (daemon/agent.py
FailureLog). This node's file is read where the agent wrote it; the other nodes' files arrive
with their report records (PullReports, daemon/multinode.py) in reports/nodes/<address>/, so a
rank that failed on another node is named with that node, not only as the peer this node's
ranks lost. A failure an agent did not restart from is its exit error (the agent_exit fault).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ds3d.trainer.kinds import EventKind

from .agent import FAULTS_SUFFIX
from .jobdir import JobDir
from .metrics import Metrics
from .multinode import pulled_node_name
from .store import Job, Store


class GroupFailures:
    """Reads one job's agents' faults files into `fault` events (cause worker_exit)."""

    def __init__(self, store: Store, metrics: Metrics, name: str, jobdir: JobDir,
                 log: Any) -> None:
        self.store, self.metrics, self.name, self.jobdir, self.log = \
            store, metrics, name, jobdir, log

    def record(self, job: Job) -> None:
        """One event per group an agent of the current attempt restarted. Called before the
        report records are read, so the fault is stored ahead of the restarted group's
        `recovery` event; each file's read offset is committed with its events (no fault lost
        or doubled across a daemon restart)."""
        name = f"agent-{job.attempt}{FAULTS_SUFFIX}"
        self._ingest(job, name, self.jobdir.path / "control" / name, "")
        for mirror in sorted((self.jobdir.reports / "nodes").glob(f"*/{name}")):
            self._ingest(job, f"nodes/{mirror.parent.name}/{name}", mirror,
                         pulled_node_name(mirror.parent))

    def _ingest(self, job: Job, key: str, path: Path, node: str) -> None:
        """The new lines of one agent's faults file (offset kept under `key`) as events;
        `node`: the node whose agent wrote it, "" for this one."""
        offset = self.store.offsets(self.name).get(key, 0)
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except OSError:  # none yet: no group of this attempt failed
            return
        whole = data[:data.rfind(b"\n") + 1]
        if not whole:
            return
        events = []
        where = f" on node {node}" if node else ""
        for line in whole.decode(errors="replace").splitlines():
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict) or not rec.get("restarted"):
                    continue
                at, rank = float(rec.get("time") or time.time()), int(rec.get("rank", -1))
            except (ValueError, TypeError):  # a damaged line: passed over, never every tick
                continue
            events.append({
                "time": at, "kind": EventKind.FAULT,
                "cause": "worker_exit", "rank": rank, "step": job.step,
                "message": f"worker group failed after step {job.step}{where}: "
                           f"{rec.get('message', '')}; the agent restarts the group",
                "detail": {**rec, "node": node} if node else rec,
                **({"node": node} if node else {})})
        self.store.ingest(self.name, {key: offset + len(whole)}, events)
        for ev in events:
            self.metrics.faults.labels(self.name, "worker_exit").inc()
            self.log.warning(EventKind.FAULT, cause="worker_exit", detail=ev["message"],
                             step=job.step)
