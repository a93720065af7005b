"""Node to node: the head daemon of a multi-node job asks the other nodes' daemons to start or
stop their share of the workers, and asks how they are.

Calls go over mutual TLS (the certificate the daemon serves with) and carry the peer credential:
the node-to-node RPCs are refused to anyone who is not one of the job's daemons (auth.py: the
peer token of --peer-token-file and/or a certificate named in --peer-names); a job request
forwarded to its head carries the client token. A daemon without TLS calls only loopback and
unix-socket peers (several daemons on one machine, as in the tests); any other peer address is
refused before a byte is sent. What a peer asks for is checked like a client's request: StartShare
validates the job as StartJob does, ShareControl writes only the known control files and no
`inject.json` on a daemon started without --enable-fault-injection.

`Shares` is the receiving side: the agents this node runs for jobs headed elsewhere, each in
`STATE_DIR/shares/<job>/` (a job directory like the head's). Besides starting and stopping its
agent, the head copies control files into it (ShareControl: rank 0, which reads commands, may
land on any node) and pulls its report records (PullReports) so that the head sees every rank.
Running agents are held in memory. A restarted daemon finds the newest agent of each share again
by the pid file the agent wrote (`Shares._reattach`) when it still runs or its workers finished
(exit 0), unless the head ended the job (StopShare leaves `control/share-stopped.json`): NodeStatus
then reports it as before the restart, and a share whose workers exited leaving checkpoints not
durable resumes uploading them (daemon/backlog_upload.py). An agent that was killed is not taken
back: the head re-issues StartShare on its next relaunch (an elastic job running short of nodes
is relaunched as soon as the node answers again: ReturningNodes). The share's folder stays, so
this node still knows which daemon heads the job and forwards job requests there (api.py).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ds3d.checkpoints.identity import local_job_id
from ds3d.checkpoints.node_memory import remove_job_folder
from ds3d.trainer.config import JobConfig
from ds3d.trainer.errors import ConfigError, Ds3dError, StateError, StorageError
from ds3d.trainer.fileio import atomic_write_text
from ds3d.trainer.report import parse_segment_name, report_segments
from ds3d.v1 import control_pb2 as pb
from ds3d.v1 import control_pb2_grpc as pb_grpc

from .auth import TlsFiles, is_local_address
from .backlog_upload import MAX_RETRY_S, BacklogUpload
from .errors import ANSWERED_BY
from .jobdir import JobDir
from .launcher import AgentHandle, Launcher, kill_strays
from .logging import get_logger
from .semaphores import release as release_semaphores

log = get_logger("ds3d.peers")


class PeerError(StorageError):
    """A peer daemon could not be reached or refused (retryable: the node may come back)."""

    retryable = True


class HeadReplacingError(Ds3dError):
    """An etcd-mode job's head is gone and no survivor leads it yet (retryable: one takes the
    job over within seconds)."""

    grpc_code = "UNAVAILABLE"
    retryable = True


class ForwardedError(Ds3dError):
    """The head daemon refused a request this node forwarded: same status, same message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.grpc_code = code


INJECT_FILE = "inject.json"  # jobdir.py: a drill's fault injection for the workers
# in a share's control/: the head ended the job (StopShare), so a restarted daemon neither takes
# its agent back nor resumes its backlog; a StartShare removes it (not a ShareControl file)
STOPPED_FILE = "share-stopped.json"
REPORT_FILE_RE = re.compile(r"^rank-\d{5,}(\.\d{6,})?\.jsonl$")  # trainer/report.py segments
# the node's elastic agent's group failures (control/agent-<attempt>.faults, daemon/agent.py)
FAULTS_FILE_RE = re.compile(r"^agent-\d+\.faults$")
# report bytes in one PullReports answer: with each chunk's framing it stays under the 4 MiB that
# a gRPC client receives by default (a 4 MiB budget made an answer of 4 MiB + 63 bytes that the
# head refused on every pull: the node's reports never arrived again)
PULL_MAX_BYTES = 3 << 20


def check_peer_address(address: str, tls: TlsFiles | None) -> None:
    """Peers beyond loopback only over mutual TLS (ConfigError naming the flags otherwise)."""
    if tls is None and not is_local_address(address):
        raise ConfigError(
            f"node {address!r} is not on this machine: calls between daemons beyond loopback "
            "need mutual TLS and a token; start every ds3dd with --tls-cert, --tls-key, "
            "--tls-ca and --token-file (or use loopback/unix addresses for local nodes)")


@dataclass(frozen=True)
class PeerClient:
    """Calls to other daemons with this daemon's client credentials."""

    tls: TlsFiles | None
    token: str | None  # the client token: for job requests forwarded to a head
    timeout_s: float = 30.0
    peer_token: str | None = None  # the peer credential: for node-to-node calls

    def _stub(self, address: str) -> tuple[grpc.Channel, pb_grpc.ControlStub]:
        try:
            check_peer_address(address, self.tls)
        except ConfigError as e:
            raise PeerError(str(e)) from None
        if self.tls is not None:
            channel = grpc.secure_channel(address, self.tls.channel_credentials())
        else:
            channel = grpc.insecure_channel(address)
        return channel, pb_grpc.ControlStub(channel)

    def forward(self, address: str, method: str, request: Any) -> Any:
        """A client RPC passed on to the head daemon of a job; its refusal comes back as the
        same status and message (ForwardedError), an unreachable head as UNAVAILABLE."""
        channel, stub = self._stub(address)
        try:
            return getattr(stub, method)(request, timeout=self.timeout_s,
                                         metadata=self._md(client=True))
        except grpc.RpcError as e:
            code = e.code()
            # an UNAVAILABLE the head itself answered (a store it cannot reach, a job being
            # taken over) is passed on as it is, not taken for a head that did not answer
            answered = ANSWERED_BY in tuple(e.trailing_metadata() or ())
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and \
                    not answered:
                raise PeerError(f"the job's head daemon {address} did not answer "
                                f"({code.name}); ask it directly or retry") from None
            raise ForwardedError(code.name, e.details()) from None
        finally:
            channel.close()

    def share_control(self, address: str, name: str, file: str, text: str,
                      leader_token: int = 0) -> bool:
        channel, stub = self._stub(address)
        try:
            req = pb.ShareControlRequest(name=name, file=file, text=text,
                                         leader_token=leader_token)
            return bool(stub.ShareControl(req, timeout=self.timeout_s,
                                          metadata=self._md()).present)
        except grpc.RpcError as e:
            raise PeerError(f"node {address}: ShareControl failed: {e.code().name}: "
                            f"{e.details()}") from None
        finally:
            channel.close()

    def pull_reports(self, address: str, name: str, offsets: dict[str, int],
                     timeout_s: float = 5.0) -> pb.PullReportsResponse:
        channel, stub = self._stub(address)
        try:
            resp: pb.PullReportsResponse = stub.PullReports(
                pb.PullReportsRequest(name=name, offsets=offsets), timeout=timeout_s,
                metadata=self._md())
            return resp
        except grpc.RpcError as e:
            raise PeerError(f"node {address}: PullReports failed: {e.code().name}: "
                            f"{e.details()}") from None
        finally:
            channel.close()

    def _md(self, client: bool = False) -> list[tuple[str, str]]:
        """Node-to-node calls carry the peer token (or, with peers recognised by certificate
        only, the client token, which is then just authentication); forwarded job requests the
        client token."""
        token = self.token if client else (self.peer_token or self.token)
        return [("authorization", f"Bearer {token}")] if token else []

    def start_share(self, address: str, req: pb.StartShareRequest) -> pb.StartShareResponse:
        channel, stub = self._stub(address)
        try:
            resp: pb.StartShareResponse = stub.StartShare(req, timeout=self.timeout_s,
                                                          metadata=self._md())
            return resp
        except grpc.RpcError as e:
            raise PeerError(f"node {address}: StartShare failed: {e.code().name}: "
                            f"{e.details()}") from None
        finally:
            channel.close()

    def stop_share(self, address: str, name: str, now: bool, leader_token: int = 0) -> bool:
        channel, stub = self._stub(address)
        try:
            return bool(stub.StopShare(pb.StopShareRequest(name=name, now=now,
                                                           leader_token=leader_token),
                                       timeout=self.timeout_s, metadata=self._md()).was_running)
        except grpc.RpcError as e:
            log.warning("StopShare failed", peer=address, job=name, code=e.code().name)
            return False
        finally:
            channel.close()

    def status(self, address: str, timeout_s: float | None = None) -> pb.NodeStatusResponse:
        channel, stub = self._stub(address)
        try:
            resp: pb.NodeStatusResponse = stub.NodeStatus(
                pb.NodeStatusRequest(), timeout=timeout_s or self.timeout_s, metadata=self._md())
            return resp
        except grpc.RpcError as e:
            raise PeerError(f"node {address}: NodeStatus failed: {e.code().name}") from None
        finally:
            channel.close()


class ReturningNodes:
    """The nodes of a job that answer again without a live share of it: a lost node's daemon
    came back (restarted, or a fresh one at the same address). The head takes them back so
    that an elastic job grows back (supervisor: _welcome_back). Asked at most every `every_s`,
    with a short timeout (a dead address must not stall the supervisor's tick); a node taken
    back is not asked again for `offered_wait_s` (its new agent needs time to start)."""

    def __init__(self, peers: PeerClient, every_s: float = 2.0, offered_wait_s: float = 60.0,
                 timeout_s: float = 2.0) -> None:
        self.peers = peers
        self.every_s, self.offered_wait_s, self.timeout_s = every_s, offered_wait_s, timeout_s
        self._next_poll = 0.0
        self._offered: dict[str, float] = {}  # address -> monotonic time of the offer

    def poll(self, name: str, addresses: list[str]) -> list[str]:
        now = time.monotonic()
        if now < self._next_poll:
            return []
        self._next_poll = now + self.every_s
        back = []
        for address in addresses:
            if now - self._offered.get(address, -1e9) < self.offered_wait_s:
                continue
            try:
                status = self.peers.status(address, timeout_s=self.timeout_s)
            except PeerError:
                continue  # still gone
            if not any(sh.job == name and sh.agent_alive for sh in status.shares):
                back.append(address)
        return back

    def offered(self, address: str) -> None:
        self._offered[address] = time.monotonic()


class Shares:
    """Agents this node runs for jobs whose head is another node."""

    def __init__(self, shares_root: Path, launcher: Launcher,
                 enable_fault_injection: bool = False,
                 backlog_retry_max_s: float = MAX_RETRY_S) -> None:
        self.root = shares_root
        self.launcher = launcher
        self.enable_fault_injection = enable_fault_injection
        self.backlog_retry_max_s = backlog_retry_max_s  # ds3dd --backlog-retry-max
        self._agents: dict[str, AgentHandle] = {}
        self._run_ids: dict[str, str] = {}  # job -> run id of the attempt last started here
        # job -> (its run ids' prefix, the highest leader token seen): etcd mode's fencing
        self._tokens: dict[str, tuple[str, int]] = {}
        self._run_ids.update(self._last_run_ids())  # a restarted daemon watches them again
        self._agents.update(self._reattach())  # and reports them (and their backlogs) again
        self._configs: dict[str, tuple[int, JobConfig]] = {}  # job -> (job.json mtime, parsed)
        # etcd-mode jobs: (lease holder as the takeover watch last read it, "" for nobody;
        # the wall time it changed to that), by job
        self._leaders: dict[str, tuple[str, float]] = {}
        # shares whose workers exited with checkpoints not durable yet (daemon/backlog_upload.py)
        self._backlogs: dict[str, BacklogUpload | None] = {}  # None: nothing was left
        self._lock = threading.Lock()

    def start(self, req: pb.StartShareRequest) -> AgentHandle:
        """Starts (or restarts) this node's agent of the job; `req` was checked by the servicer
        (api.py: parse_config, check_share_request)."""
        try:
            cfg = JobConfig.model_validate_json(req.config_json)
        except ValueError as e:
            raise ConfigError(f"StartShare: the job configuration does not parse: {e}") from None
        jobdir = JobDir(self.root, cfg.name)
        with self._lock:
            self._fence(cfg.name, req.leader_token, "StartShare",
                        run_id_prefix=req.run_id.rpartition("-a")[0])
            old = self._agents.get(cfg.name)
            if old is not None and old.poll() is None:
                old.ref.terminate()
            backlog = self._backlogs.pop(cfg.name, None)
            if backlog is not None:  # the new workers resume those uploads themselves
                backlog.close()
            # its workers too (own sessions): none may hold the job's build lock at the start
            kill_strays(jobdir.path)
            release_semaphores(jobdir.path)
            jobdir.create(cfg.dump_json())
            (jobdir.control / STOPPED_FILE).unlink(missing_ok=True)
            # commands were meant for the previous workers; the head re-sends what is pending
            jobdir.command_file.unlink(missing_ok=True)
            handle = self.launcher.start(jobdir.path, cfg, req.attempt, req.rdzv_endpoint,
                                         req.run_id)
            self._agents[cfg.name] = handle
            self._run_ids[cfg.name] = req.run_id
        log.info("share started", job=cfg.name, head=req.head_node, pid=handle.ref.pid)
        return handle

    def _fence(self, name: str, token: int, what: str, run_id_prefix: str = "") -> None:
        """Refuses a request of a deposed leader: one whose lease token is lower than a token
        this node already saw for the job (etcd mode; token 0: c10d mode, one fixed head). A
        StartShare of another job of the same name (another run id prefix) starts afresh.
        Called under the lock, so a request and its token are one step."""
        seen_prefix, newest = self._tokens.get(name, ("", 0))
        if run_id_prefix and run_id_prefix != seen_prefix:
            seen_prefix, newest = run_id_prefix, 0
        if token and token < newest:
            raise StateError(f"{what} for job {name!r} refused: it comes from a deposed leader "
                             f"(lease token {token}); the job's leader now holds token "
                             f"{newest}")
        self._tokens[name] = (seen_prefix, max(token, newest))

    def started(self) -> list[tuple[JobConfig, str]]:
        """The jobs this daemon started (or, before a restart, ran) a share of, with the run id
        of the newest attempt. Each job.json is parsed again only when it changed: the takeover
        watch asks every second."""
        with self._lock:
            run_ids = dict(self._run_ids)
        out = []
        for name, run_id in sorted(run_ids.items()):
            jobdir = self._jobdir(name)
            if jobdir is None:
                continue
            try:
                stamp = jobdir.job_json.stat().st_mtime_ns
                held = self._configs.get(name)
                if held is None or held[0] != stamp:
                    held = (stamp, JobConfig.model_validate_json(jobdir.job_json.read_text()))
                    self._configs[name] = held
            except (OSError, ValueError):
                continue
            out.append((held[1], run_id))
        return out

    def _newest_specs(self) -> dict[str, tuple[int, Path]]:
        """Each share's newest attempt and its agent spec (control/agent-<attempt>.json,
        written by Launcher.start)."""
        out = {}
        for job_json in self.root.glob("*/job.json"):
            specs = []
            for spec in job_json.parent.glob("control/agent-*.json"):
                attempt = spec.stem.removeprefix("agent-")
                if attempt.isdigit():
                    specs.append((int(attempt), spec))
            if specs:
                out[job_json.parent.name] = max(specs)
        return out

    def _last_run_ids(self) -> dict[str, str]:
        """The run id of each share's newest attempt, from its agent spec."""
        out = {}
        for name, (_attempt, spec) in self._newest_specs().items():
            try:
                run_id = json.loads(spec.read_text())["run_id"]
            except (OSError, ValueError, KeyError, TypeError):  # damaged: the head re-sends
                continue
            if isinstance(run_id, str) and run_id:
                out[name] = run_id
        return out

    def _reattach(self) -> dict[str, AgentHandle]:
        """After a restart of this daemon: the newest agent of each share that still runs or
        whose workers finished (exit 0), found by the pid file it wrote (Launcher.find: pid and
        start time, so a reused pid is not taken for it). Skipped: shares whose head ended the
        job (STOPPED_FILE) and agents that were killed or failed (the head relaunches those
        with a StartShare). `status` then reports them as before the restart, and starts the
        backlog of a share whose workers exited with checkpoints not durable."""
        out = {}
        for name, (attempt, _spec) in self._newest_specs().items():
            run_dir = self.root / name
            if (run_dir / "control" / STOPPED_FILE).exists():
                continue
            try:
                handle = Launcher.find(run_dir, attempt)
            except (KeyError, TypeError, ValueError):
                handle = None  # a pid file not as the agent writes it
            if handle is not None and handle.poll() in (None, 0):
                out[name] = handle
                log.info("share agent found again", job=name, pid=handle.ref.pid,
                         alive=handle.poll() is None)
        return out

    def forget(self, name: str) -> None:
        """No more watching of `name` (daemon/takeover.py) until its next StartShare."""
        with self._lock:
            self._run_ids.pop(name, None)
            self._leaders.pop(name, None)

    def leader_seen(self, name: str, holder: str) -> None:
        """The etcd lease holder of `name` as the takeover watch just read it ("" when the
        lease has expired and nobody holds it yet): where the job's calls are forwarded."""
        with self._lock:
            seen = self._leaders.get(name)
            if seen is None or seen[0] != holder:
                self._leaders[name] = (holder, time.time())

    def etcd_led(self, name: str) -> bool:
        """True when `name`'s head is whoever holds its etcd lease (not a fixed first host)."""
        with self._lock:
            return name in self._leaders

    def stop_and_wait(self, name: str, timeout_s: float = 30.0) -> None:
        """Ends this node's share of `name` and its workers (a successor leader relaunches)."""
        with self._lock:
            handle = self._agents.get(name)
            self._run_ids.pop(name, None)
        if handle is not None and handle.poll() is None:
            handle.ref.terminate(grace_s=min(timeout_s, 5.0))
        kill_strays(JobDir(self.root, name).path)
        release_semaphores(JobDir(self.root, name).path)

    def _jobdir(self, name: str) -> JobDir | None:
        jobdir = JobDir(self.root, name)
        return jobdir if jobdir.job_json.is_file() else None

    def head_address(self, name: str) -> str | None:
        """The address of the daemon heading `name`, if this node ran a share of it: for an
        etcd-mode job the holder of its lease (so every survivor forwards to a new leader as
        soon as it holds the lease; HeadReplacingError while nobody does), else the job's
        first host."""
        jobdir = self._jobdir(name)
        if jobdir is None:
            return None
        with self._lock:
            seen = self._leaders.get(name)
        if seen is not None:
            holder, since = seen
            if not holder:
                raise HeadReplacingError(
                    f"job {name!r}: its head is being replaced (leader lease expired "
                    f"{time.time() - since:.0f} s ago, no survivor holds it yet); retry in a "
                    f"few seconds")
            return holder
        try:
            hosts = JobConfig.model_validate_json(jobdir.job_json.read_text()).launch.hosts
        except ValueError:
            return None
        return hosts[0] if hosts else None

    def names(self) -> list[str]:
        return sorted(p.parent.name for p in self.root.glob("*/job.json"))

    def control(self, name: str, file: str, text: str, leader_token: int = 0) -> bool:
        """Writes a control file the head sent; False if this node has no share of `name`."""
        with self._lock:
            self._fence(name, leader_token, "ShareControl")
        if file == INJECT_FILE and text and not self.enable_fault_injection:
            raise StateError("fault injection is disabled on this node; restart its ds3dd with "
                             "--enable-fault-injection to allow it (drills only)")
        jobdir = self._jobdir(name)
        if jobdir is None:
            return False
        jobdir.write_control(file, text)
        return True

    def pull(self, name: str, offsets: dict[str, int],
             max_bytes: int = 0) -> list[pb.ReportChunk] | None:
        """Whole report lines after the head's offsets (None if no share of `name`): the head's
        copies are its `offsets` (file -> size). Each rank's segments go in order, a segment
        only once the one before it was sent to its end (but for a torn last line), so a
        segment older than the head's newest copy of its rank that the head no longer has was
        copied whole, tailed and deleted there: it is deleted here too (trainer/report.py).
        The agent's faults files (control/agent-<attempt>.faults) come the same way, first."""
        jobdir = self._jobdir(name)
        if jobdir is None:
            return None
        budget = min(max_bytes, PULL_MAX_BYTES) if max_bytes > 0 else PULL_MAX_BYTES
        head_newest: dict[int, int] = {}  # rank -> the newest segment the head has a copy of
        for file in offsets:
            parsed = parse_segment_name(file)
            if parsed is not None:
                head_newest[parsed[0]] = max(head_newest.get(parsed[0], -1), parsed[1])
        chunks = []
        # first (a few lines), the node's agent's group failures: the head names the rank a
        # failure began with in its fault event
        for path in sorted(jobdir.control.glob("agent-*.faults")):
            start = offsets.get(path.name, 0)
            if budget <= 0 or not FAULTS_FILE_RE.match(path.name) or start < 0:
                continue
            with open(path, "rb") as fh:
                fh.seek(start)
                data = fh.read(budget)
            cut = data[:data.rfind(b"\n") + 1]
            if cut:
                chunks.append(pb.ReportChunk(file=path.name, offset=start, data=cut))
                budget -= len(cut)
        held_back: set[int] = set()  # ranks with a segment not sent to its end
        for path in report_segments(jobdir.reports):
            rank, segment = parse_segment_name(path.name) or (-1, -1)
            start = offsets.get(path.name, 0)
            if path.name not in offsets and segment < head_newest.get(rank, -1):
                path.unlink(missing_ok=True)
                continue
            if budget <= 0 or start < 0:
                break
            if rank in held_back:
                continue
            with open(path, "rb") as fh:
                fh.seek(start)
                data = fh.read(budget)
                whole = fh.read(1) == b""
            cut = data[:data.rfind(b"\n") + 1]
            if not whole:
                held_back.add(rank)
            if cut:
                chunks.append(pb.ReportChunk(file=path.name, offset=start, data=cut))
                budget -= len(cut)
        return chunks

    def stop(self, name: str, now: bool, leader_token: int = 0) -> bool:
        """The head ended the job (terminal): its agent is ended, a backlog still uploading is
        closed (stop --now and FAILED do not wait for the store: what is left stays on the
        local tier, as on the head) and the share is marked ended for a restarted daemon."""
        with self._lock:
            self._fence(name, leader_token, "StopShare")
            handle = self._agents.get(name)  # kept: NodeStatus reports how it ended
            backlog = self._backlogs.get(name)
        if backlog is not None and backlog.pending():  # returns after the attempt in flight
            backlog.close()
            log.info("share backlog closed: the job ended", job=name, left=backlog.pending())
        jobdir = self._jobdir(name)
        try:
            if jobdir is not None:
                atomic_write_text(jobdir.control / STOPPED_FILE,
                                  json.dumps({"time": time.time()}))
        except OSError as e:  # a restarted daemon would report the ended share again
            log.warning("share not marked ended", job=name, error=str(e))
        # the job ended: its ranks' newest save kept in this node's memory is RAM
        job_id = local_job_id(jobdir.path) if jobdir is not None else None
        if handle is None or handle.poll() is not None:
            remove_job_folder(job_id)
            if jobdir is not None:
                release_semaphores(jobdir.path)
            return False
        handle.ref.terminate(grace_s=1.0 if now else 30.0)
        remove_job_folder(job_id)
        if jobdir is not None:
            release_semaphores(jobdir.path)
        return True

    def status(self) -> list[pb.ShareStatus]:
        with self._lock:
            items = list(self._agents.items())
        out = []
        for name, h in items:
            code = h.poll()
            if code is not None:
                self._upload_backlog(name)
            out.append(pb.ShareStatus(job=name, agent_alive=code is None, agent_pid=h.ref.pid,
                                      exit_code=-1 if code is None else code))
        return out

    def _upload_backlog(self, name: str) -> None:
        """This node's share of `name` has exited: its ranks' checkpoints not durable yet are
        uploaded (and, holding rank 0, committed) by this daemon, as the head does for its own
        (daemon/backlog_upload.py); once, until the next StartShare."""
        with self._lock:
            if name in self._backlogs:
                return
        jobdir = self._jobdir(name)
        if jobdir is None:
            return
        try:
            cfg = JobConfig.model_validate_json(jobdir.job_json.read_text())
            local = Path(cfg.checkpoint.local_dir) if cfg.checkpoint.local_dir else jobdir.ckpt
            backlog = BacklogUpload.start_if_needed(cfg, local_job_id(jobdir.path) or "",
                                                    jobdir.path, local,
                                                    max_retry_s=self.backlog_retry_max_s)
        except (Ds3dError, OSError, ValueError) as e:
            log.warning("share backlog not uploaded", job=name, error=str(e))
            return
        with self._lock:
            self._backlogs[name] = backlog
        if backlog is None:
            return
        backlog.finish_when_done()
        log.info("share backlog uploading", job=name, steps=backlog.steps)

    def stop_all(self) -> None:
        """Daemon shutdown: shares keep running (like the daemon's own agents)."""
        with self._lock:
            self._agents.clear()
