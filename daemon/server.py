"""Assembling one daemon: store, supervisors, services, the gRPC server and metrics.

`Daemon` owns everything it starts and stops it in `close()`, except the job processes (agents,
rendezvous stores): those live in their own sessions and outlive the daemon by design; the next
daemon on the same state directory reattaches to them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ds3d.trainer.errors import ConfigError, Ds3dError
from ds3d.trainer.kinds import EventKind
from ds3d.v1 import control_pb2 as pb
from ds3d.v1 import control_pb2_grpc as pb_grpc

from .api import ControlServicer
from .auth import AuthInterceptor, PeerAuth, TlsFiles, check_listen_policy
from .backlog_upload import MAX_RETRY_S
from .errors import ErrorInterceptor
from .fit_check import node_resources
from .job_detectors import standard_detectors
from .launcher import WORKER_MODULE, Launcher
from .logging import get_logger
from .metrics import Metrics
from .peers import PeerClient, Shares
from .policies import restart_policy_for
from .procs import ProcessRef
from .reflection_v1 import enable_reflection_v1
from .service import JobService, stored_config_problem
from .store import EVENTS_KEPT, Event, Store
from .supervisor import SupervisorContext
from .supervisors import Supervisors
from .takeover import Standby

log = get_logger("ds3d.daemon")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Control"].full_name
RPC_THREADS = 32  # calls served at once; more wait in gRPC's queue
# a followed WatchEvents holds a thread until its client leaves: 32 of them (32 forgotten
# `ds3dctl events -f`) left no thread for any other call (status, stop, health, peers)
FOLLOWED_WATCHES_MAX = RPC_THREADS - 8


@dataclass
class DaemonOptions:
    state_dir: Path
    listen: str = "127.0.0.1:7531"
    node: str = socket.gethostname()
    token: str | None = None
    tls: TlsFiles | None = None
    metrics_port: int | None = None
    max_request_bytes: int = 1 << 20
    rdzv_host: str = "127.0.0.1"
    worker_module: str = WORKER_MODULE
    hang_timeout_s: float = 120.0
    start_timeout_s: float = 600.0
    peer: PeerAuth = PeerAuth()  # how the other daemons of a job are recognised (auth.py)
    enable_fault_injection: bool = False
    report_gpu_memory: int | None = None  # bytes of one GPU, instead of nvidia-smi's (tests)
    node_addr: str | None = None
    events_kept: int = EVENTS_KEPT  # newest step/checkpoint events per job and kind (store.py)
    backlog_retry_max_s: float = MAX_RETRY_S  # longest wait between backlog upload attempts


def check_listen_address(listen: str) -> None:
    """`--listen` is HOST:PORT with a port of 0..65535 (grpcio itself binds 99999 to a random
    port without a word) and, unless 0, a port free on this host: a refusal is one ConfigError
    line, before anything is bound or started."""
    if listen.startswith("unix:"):
        if not listen[5:]:
            raise ConfigError("--listen unix: needs a socket path, e.g. unix:/run/ds3d.sock")
        return
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--listen {listen!r}: use HOST:PORT with a port from 1 to 65535 (0 "
                          "picks a free one), or unix:PATH")
    if int(port) == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--listen {listen!r}: cannot resolve {host!r} ({e.strerror}); give "
                          "an address of this host") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpcio binds
        try:
            probe.bind(address)
        except OSError as e:
            why = f"port {port} is already in use (another ds3dd?)" if \
                e.errno == errno.EADDRINUSE else e.strerror
            raise ConfigError(f"cannot listen on {listen!r}: {why}; choose another --listen "
                              "port or stop what holds it") from None


class Daemon:
    def __init__(self, opts: DaemonOptions) -> None:
        check_listen_address(opts.listen)
        check_listen_policy(opts.listen, opts.tls, opts.token)
        self.opts = opts
        opts.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fh = open(opts.state_dir / "ds3dd.lock", "w")
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another ds3dd already uses --state-dir {opts.state_dir}; stop "
                              "it first or choose another state directory") from None
        self.store = Store(opts.state_dir / "ds3d.db", events_kept=opts.events_kept)
        for job in self.store.quarantine_unreadable(stored_config_problem):
            log.error("job quarantined", job=job.name, reason=job.message)
            for pid, started in ((job.agent_pid, job.agent_started),
                                 (job.rdzv_pid, job.rdzv_started)):
                ProcessRef(pid, started).terminate(grace_s=5.0)
        self.metrics = Metrics()
        launcher = Launcher(worker_module=opts.worker_module, node_addr=opts.node_addr)
        peers = PeerClient(opts.tls, opts.token, peer_token=opts.peer.token)
        jobs_root = opts.state_dir / "jobs"
        jobs_root.mkdir(exist_ok=True)
        self.supervisors = Supervisors(SupervisorContext(
            store=self.store, launcher=launcher, metrics=self.metrics, jobs_root=jobs_root,
            node=opts.node, rdzv_host=opts.rdzv_host, peers=peers,
            detectors=standard_detectors(opts.hang_timeout_s, opts.start_timeout_s),
            restart_policy=restart_policy_for, backlog_retry_max_s=opts.backlog_retry_max_s))
        self.shares = Shares(opts.state_dir / "shares", launcher,
                             enable_fault_injection=opts.enable_fault_injection,
                             backlog_retry_max_s=opts.backlog_retry_max_s)
        self.peers = peers
        self.service = JobService(self.store, self.supervisors, jobs_root, opts.node,
                                  peers=peers,
                                  enable_fault_injection=opts.enable_fault_injection,
                                  resources=node_resources(opts.report_gpu_memory))
        log.info("node resources", **vars(self.service.resources))
        self.server: grpc.Server | None = None
        self.health: health.HealthServicer | None = None
        self.address = ""
        self.metrics_port: int | None = None

    def start(self) -> str:
        """Binds, registers Control + health + reflection, starts serving and supervising;
        returns the bound address (port 0 resolved) and writes it to STATE_DIR/ds3dd.addr."""
        interceptors: list[grpc.ServerInterceptor] = []
        interceptors.append(AuthInterceptor(self.opts.token, self.opts.peer))
        interceptors.append(ErrorInterceptor(
            on_call=lambda method: self.metrics.rpcs.labels(method).inc()))
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=RPC_THREADS, thread_name_prefix="rpc"),
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", self.opts.max_request_bytes),
                     ("grpc.max_send_message_length", 16 << 20),
                     ("grpc.so_reuseport", 0)])
        pb_grpc.add_ControlServicer_to_server(
            ControlServicer(self.service, self.shares, self.opts.node, self.peers,
                            followed_watches_max=FOLLOWED_WATCHES_MAX), server)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        services = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection_v1 = enable_reflection_v1(services, server)
        reflection.enable_server_reflection(
            (*services, *([reflection_v1] if reflection_v1 else [])), server)
        listen = self.opts.listen
        try:
            if self.opts.tls is not None:
                port = server.add_secure_port(listen, self.opts.tls.server_credentials())
            else:
                port = server.add_insecure_port(listen)
        except RuntimeError:  # grpcio: "Failed to bind to address ..."
            raise ConfigError(f"cannot listen on {listen!r} (address in use or invalid); "
                              "choose another --listen") from None
        if not listen.startswith("unix:") and port == 0:
            raise ConfigError(f"cannot listen on {listen!r} (address in use or invalid)")
        self.address = listen if listen.startswith("unix:") else \
            f"{listen.rsplit(':', 1)[0]}:{port}"
        server.start()
        self.server = server
        self.health = health_servicer
        for svc in ("", SERVICE_NAME):
            health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
        if self.opts.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.serve(self.opts.metrics_port)
            except OSError as e:
                why = "it is already in use" if e.errno == errno.EADDRINUSE else e.strerror
                raise ConfigError(f"cannot serve metrics on 127.0.0.1:{self.opts.metrics_port} "
                                  f"({why}); give another --metrics-port (0 picks a free one)"
                                  ) from None
        self.supervisors.ctx.address = self.address  # an etcd-mode job's leader is named so
        self.supervisors.resume_all()
        standby = Standby(self.store, self.shares, self.supervisors.ctx.jobs_root,
                          self.opts.node, self.supervisors.adopt, lambda: self.address)
        threading.Thread(target=standby.run, args=(self.supervisors.stopping,),
                         name="standby", daemon=True).start()
        addr_file = self.opts.state_dir / "ds3dd.addr"
        tmp = addr_file.with_suffix(".tmp")
        tmp.write_text(self.address)
        os.replace(tmp, addr_file)
        log.info("serving", address=self.address, metrics_port=self.metrics_port,
                 tls=self.opts.tls is not None, token=bool(self.opts.token))
        return self.address

    def wait(self) -> None:
        if self.server is not None:
            self.server.wait_for_termination()

    def drain(self, timeout_s: float) -> list[str]:
        """Graceful shutdown: every running job this node heads is paused (checkpoint, then the
        workers stop) and marked to resume when a daemon starts on this state directory again.
        Returns the jobs paused."""
        from .states import JobState

        self._not_serving()
        paused = []
        for job in self.store.list_jobs():
            if job.state in (JobState.RUNNING, JobState.STARTING, JobState.RECOVERING) and \
                    job.desired_state is JobState.RUNNING:
                try:
                    self.service.pause(job.name)
                except Ds3dError as e:
                    log.warning("drain: cannot pause", job=job.name, error=str(e))
                    continue
                self.store.record(job.name, EventKind.DRAIN, "paused for daemon shutdown; "
                                  "resumes when ds3dd starts again")
                paused.append(job.name)
        deadline = time.monotonic() + timeout_s
        while paused and time.monotonic() < deadline:
            states = {n: self.store.get_job(n).state for n in paused}
            if all(st is not JobState.RUNNING and st is not JobState.STARTING
                   and st is not JobState.RECOVERING for st in states.values()):
                break
            self.store.wait_for_change(0.5)
        states = {n: self.store.get_job(n).state for n in paused}
        late = [n for n, st in states.items() if st.live and st is not JobState.PAUSED]
        if late:
            log.warning("drain_timeout", jobs=late, timeout_s=timeout_s,
                        detail="not paused within --drain-timeout: their workers keep running "
                        "and the next ds3dd reattaches to them, carries out the pause, then "
                        "resumes them")
        return paused

    def resume_drained(self) -> list[str]:
        """Resumes the jobs the previous daemon paused at its shutdown (and nothing else).
        One whose pause that daemon's drain gave up on (still live, its pause pending: the
        workers were hung or saving for longer than --drain-timeout) is resumed once this
        daemon has carried the pause out; it stayed PAUSED for good before."""
        from .states import JobState

        resumed, pausing = [], {}
        for job in self.store.list_jobs():
            drain = self._drain_request(job.name) if job.state.live else None
            if drain is None:
                continue
            if job.state is JobState.PAUSED:
                self.service.resume(job.name)
                resumed.append(job.name)
            elif job.desired_state is JobState.PAUSED:
                pausing[job.name] = drain
        if pausing:
            log.info("drained jobs still pausing: each resumes once its pause is carried out",
                     jobs=sorted(pausing))
            threading.Thread(target=self._resume_once_paused, args=(pausing,),
                             name="resume-drained", daemon=True).start()
        return resumed

    def _own_requests(self, name: str, after_seq: int = 0) -> list[Event]:
        """The daemon's own requests of the job after `after_seq` (rank -1: workers
        acknowledge commands with events of kind "command" too)."""
        return [e for e in self.store.events(job=name, after_seq=after_seq, limit=1 << 30,
                                             kinds=[EventKind.DRAIN, EventKind.REQUEST,
                                                    EventKind.COMMAND])
                if e.rank == -1]

    def _drain_request(self, name: str) -> int | None:
        """The sequence number of the drain's pause, when it is the daemon's last request of
        the job; else None."""
        mine = self._own_requests(name)
        return mine[-1].seq if mine and mine[-1].kind == EventKind.DRAIN else None

    def _resume_once_paused(self, pausing: dict[str, int]) -> None:
        """Follows the drained jobs still pausing (name -> the drain's event) until each is
        PAUSED (then resumes it), has ended, or was asked something else since (a stop, a
        resume: theirs to decide). Only requests newer than the drain are read at each store
        commit, not the job's whole history."""
        from .states import JobState

        stopping = self.supervisors.stopping
        while pausing and not stopping.is_set():
            for name, drain in list(pausing.items()):
                try:
                    job = self.store.get_job(name)
                    if not job.state.live or self._own_requests(name, after_seq=drain):
                        del pausing[name]
                    elif job.state is JobState.PAUSED:
                        del pausing[name]
                        self.service.resume(name)
                        log.info("resumed a job paused at the last shutdown", job=name)
                except Ds3dError as e:  # deleted, or a state that no longer allows it
                    log.warning("cannot resume a drained job", job=name, error=str(e))
                    pausing.pop(name, None)
            self.store.wait_for_change(1.0)

    def _not_serving(self) -> None:
        """Health says NOT_SERVING from the start of a shutdown (load balancers and peers stop
        sending work while the daemon drains)."""
        if self.health is not None:
            self.health.enter_graceful_shutdown()

    def close(self, grace_s: float = 2.0) -> None:
        """Stops serving and supervising; job processes keep running (reattached next start)."""
        self._not_serving()
        if self.server is not None:
            self.server.stop(grace_s).wait()
            self.server = None
        self.supervisors.stop()
        self.store.close()
        self._lock_fh.close()
        log.info("stopped")
