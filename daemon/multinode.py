"""The head node's side of one multi-node job: its other nodes, reached through peer RPCs
(daemon/peers.py).

The job's supervisor (daemon/supervisor.py) runs on the head node and asks this for what
involves the other nodes: start and stop their shares, copy control files to them (retried
until each node has them), pull their report records into reports/nodes/<node>/, and whether
their agents still run. A node that does not answer is backed off for a few seconds and
counts as unreachable meanwhile. A single-node job (or a daemon without peers) has no other
nodes: every call is then a no-op.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from ds3d.trainer.config import JobConfig
from ds3d.trainer.kinds import EventKind
from ds3d.v1 import control_pb2 as pb

from .jobdir import JobDir
from .logging import get_logger
from .metrics import Metrics
from .peers import FAULTS_FILE_RE, REPORT_FILE_RE, PeerClient, PeerError, ReturningNodes
from .store import Job, Store

BACKOFF_S = 5.0  # a node that did not answer is not called again before this


NODE_NAME_FILE = "node-name"  # in reports/nodes/<address>/: the --node-name answering there


def pulled_node_name(mirror: Path) -> str:
    """The name of the node whose reports `mirror` (reports/nodes/<address>/) holds, as it
    answered the newest pull; its address (the folder's name) before the first."""
    try:
        return (mirror / NODE_NAME_FILE).read_text().strip() or mirror.name
    except OSError:
        return mirror.name


class JobNodes:
    """The other nodes of one job headed here (none for a single-node job)."""

    def __init__(self, name: str, jobdir: JobDir, store: Store, metrics: Metrics,
                 peers: PeerClient | None, head_node: str, finish_timeout_s: float,
                 config: Callable[[Job], JobConfig]) -> None:
        self.name = name
        self.jobdir = jobdir
        self.store = store
        self.metrics = metrics
        self.peers = peers
        self.head_node = head_node
        self.finish_timeout_s = finish_timeout_s
        self.config = config
        self.log = get_logger("ds3d.supervisor", job=name)
        # lost nodes whose daemon answers again (an elastic job takes them back)
        self.returning = ReturningNodes(peers) if peers is not None else None
        self._unsent: dict[tuple[str, str], str] = {}  # (node address, file) -> text to copy
        self._backoff: dict[str, float] = {}           # node address -> monotonic retry time
        self._wait_since: float | None = None
        # etcd mode: the lease token every write to another node carries, so that a node which
        # saw a newer leader's token refuses a deposed leader's late call (0: c10d mode)
        self.leader_token: Callable[[], int] = lambda: 0

    def addresses(self, job: Job | None = None) -> list[str]:
        cfg = self.config(job or self.store.get_job(self.name))
        if cfg.launch.nnodes <= 1 or self.peers is None:
            return []
        return list(cfg.launch.hosts[1:])

    def unreachable(self) -> list[str]:
        """The nodes backed off now (they did not answer the last call)."""
        return sorted(a for a, t in self._backoff.items() if t > time.monotonic())

    def reachable_again(self, address: str) -> None:
        """A node answers again: call it at once."""
        self._backoff.pop(address, None)

    def start_shares(self, cfg: JobConfig, endpoint: str, run_id: str, attempt: int) -> int:
        """Starts each other node's agent of this attempt; returns how many started. An
        elastic job starts without the nodes it can spare (recorded as a `node_lost` fault);
        otherwise an unreachable node raises PeerError."""
        if cfg.launch.nnodes <= 1 or self.peers is None:
            return 0
        req = pb.StartShareRequest(config_json=cfg.dump_json(), head_node=self.head_node,
                                   rdzv_endpoint=endpoint, run_id=run_id, attempt=attempt,
                                   leader_token=self.leader_token())
        missing: list[str] = []
        for address in cfg.launch.hosts[1:]:
            try:
                resp = self.peers.start_share(address, req)
            except PeerError:
                # an elastic job starts without nodes it can spare (they join when back)
                if not cfg.elastic or cfg.launch.nnodes - len(missing) - 1 < \
                        (cfg.launch.min_nodes or cfg.launch.nnodes):
                    raise
                missing.append(address)
                self._backoff[address] = time.monotonic() + BACKOFF_S
                continue
            self.store.record(self.name, EventKind.SHARE, f"node {resp.node} started its share "
                              f"(agent pid {resp.agent_pid})")
        if missing:
            self.store.record(self.name, EventKind.FAULT,
                              f"node(s) {', '.join(missing)} unreachable; "
                              f"the elastic job starts on the other "
                              f"{cfg.launch.nnodes - len(missing)} (min_nodes "
                              f"{cfg.launch.min_nodes})", cause="node_lost")
            self.metrics.faults.labels(self.name, "node_lost").inc()
        return len(cfg.launch.hosts) - 1 - len(missing)

    def stop_shares(self, cfg: JobConfig) -> None:
        """The job ended: no share of it may keep running on another node."""
        if cfg.launch.nnodes > 1 and self.peers is not None:
            for address in cfg.launch.hosts[1:]:
                self.peers.stop_share(address, self.name, now=True,
                                      leader_token=self.leader_token())

    def forward_control(self, file: str, text: str, local: bool = False) -> None:
        """Copies a control file (text "" removes it; `local` also here) to every other node
        of the job; a node that cannot be reached gets it on a later tick."""
        if local:
            self.jobdir.write_control(file, text)
        for address in self.addresses():
            self._unsent[(address, file)] = text
        self._send_unsent()

    def _send_unsent(self) -> None:
        assert self.peers is not None or not self._unsent
        for (address, file), text in list(self._unsent.items()):
            if time.monotonic() < self._backoff.get(address, 0.0):
                continue
            try:
                self.peers.share_control(  # type: ignore[union-attr]
                    address, self.name, file, text, leader_token=self.leader_token())
            except PeerError as e:
                self._backoff[address] = time.monotonic() + BACKOFF_S
                self.log.warning("control file not delivered", node=address, file=file,
                                 error=str(e))
                continue
            if self._unsent.get((address, file)) == text:
                del self._unsent[(address, file)]

    def busy(self, job: Job) -> bool:
        """True while another node's agent of this job still runs after the workers here
        ended (its ranks may still be uploading their checkpoint shards or committing the
        manifest): the job ends, and its shares are stopped, only once they are done, or after
        `finish_timeout_s`. A node that does not answer counts as done."""
        addresses = self.addresses(job)
        if not addresses:
            return False
        now = time.monotonic()
        if self._wait_since is None:
            self._wait_since = now
        if now - self._wait_since > self.finish_timeout_s:
            self.log.warning("other nodes' agents did not finish; ending them",
                             waited_s=round(now - self._wait_since))
            self._wait_since = None
            return False
        for address in addresses:
            try:
                status = self.peers.status(address)  # type: ignore[union-attr]
            except PeerError as e:
                self.log.warning("node did not answer NodeStatus", node=address, error=str(e))
                continue
            if any(sh.job == self.name and sh.agent_alive for sh in status.shares):
                return True
        self._wait_since = None
        return False

    def pull_reports(self, job: Job) -> None:
        """Re-sends the control files a node missed, then appends the other nodes' new report
        lines, and their agents' faults lines, to reports/nodes/<node>/ (whole lines, at the
        offset each copy already has, so a repeated pull never duplicates a record)."""
        addresses = self.addresses(job)
        if not addresses:
            return
        self._send_unsent()
        for address in addresses:
            if time.monotonic() < self._backoff.get(address, 0.0):
                continue
            mirror = self.jobdir.reports / "nodes" / re.sub(r"[^A-Za-z0-9._-]", "_", address)
            mirror.mkdir(parents=True, exist_ok=True)
            have = {p.name: p.stat().st_size for p in mirror.iterdir()
                    if REPORT_FILE_RE.match(p.name) or FAULTS_FILE_RE.match(p.name)}
            try:
                resp = self.peers.pull_reports(address, self.name, have)  # type: ignore[union-attr]
            except PeerError as e:
                self._backoff[address] = time.monotonic() + BACKOFF_S
                self.log.warning("cannot pull reports", node=address, error=str(e))
                continue
            if resp.node and pulled_node_name(mirror) != resp.node:
                (mirror / NODE_NAME_FILE).write_text(resp.node)
            for chunk in resp.chunks:
                if not (REPORT_FILE_RE.match(chunk.file) or FAULTS_FILE_RE.match(chunk.file)) \
                        or chunk.offset != have.get(chunk.file, 0):
                    continue
                with open(mirror / chunk.file, "ab") as fh:
                    fh.write(chunk.data)
                have[chunk.file] = chunk.offset + len(chunk.data)
