"""The gRPC servicer: proto <-> domain conversion and request-shape checks only.

Every method converts its request, calls JobService (or Shares for node-to-node calls) and
converts the answer. A job request for a job headed by another daemon, of which this node runs a
share, is passed on to that head unchanged (so `ds3dctl status` answers for the whole job on
any of its nodes). Errors are raised as Ds3dError subclasses and mapped to status codes in one
place (errors.ErrorInterceptor); nothing here catches exceptions, except ListJobs, which
leaves out (and logs) a shared job whose head does not answer.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar, cast

import grpc

from ds3d.trainer.config import JOB_NAME_RULE, JobConfig, valid_job_name
from ds3d.trainer.errors import ConfigError, Ds3dError
from ds3d.trainer.partition import Prediction, current_partition
from ds3d.v1 import control_pb2 as pb
from ds3d.v1 import control_pb2_grpc as pb_grpc

from . import job_pages
from .errors import LongCallLimitError
from .job_leadership import LEASE_TTL_S
from .logging import get_logger
from .peers import HeadReplacingError, PeerClient, PeerError, Shares
from .policies import restarts_in_a_row
from .service import JobService, Rebalance, parse_config
from .store import Event, Job

R = TypeVar("R")  # a forwarded RPC's answer type

VERSION = "0.1.0"
_TERMINAL = (pb.COMPLETED, pb.FAILED, pb.STOPPED)
VERIFIES_MAX = 2  # checkpoint verifies (ListCheckpoints verify) served at once
log = get_logger("ds3d.rpc")


def _name(name: str) -> str:
    """Job names in requests: checked before any lookup (no path tricks reach the store)."""
    if not name:
        raise ConfigError("a job name is required")
    if not valid_job_name(name):
        shown = repr(name) if len(name) <= 80 else f"{name[:80]!r}... ({len(name)} characters)"
        raise ConfigError(f"job name {shown} is not allowed: use {JOB_NAME_RULE}")
    return name


def check_share_request(request: pb.StartShareRequest, job: str) -> None:
    """The launch fields of a StartShare, as the head builds them (supervisor.py,
    rendezvous.rendezvous_run_id): a malformed one would replace the node's running agent of
    the job with one that cannot start."""
    problems = []
    if not request.head_node or not request.head_node.isprintable() or \
            request.head_node != request.head_node.strip():
        problems.append(f"head_node={request.head_node!r}: the head daemon's node name")
    host, _, port = request.rdzv_endpoint.rpartition(":")
    port_ok = port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535
    if not host or not host.isprintable() or " " in host or not port_ok:
        problems.append(f"rdzv_endpoint={request.rdzv_endpoint[:80]!r}: HOST:PORT of the "
                        "job's rendezvous, a port from 1 to 65535")
    if request.attempt < 1:
        problems.append(f"attempt={request.attempt}: the head's launch attempt, 1 or more")
    rest = request.run_id.removeprefix(f"{job}-")
    if rest == request.run_id or not rest.endswith(f"a{request.attempt}") or \
            not re.fullmatch(r"([0-9a-f]{12}-)?a[0-9]+", rest):
        problems.append(f"run_id={request.run_id[:80]!r}: {job}-a{request.attempt} (or "
                        f"{job}-<job id>-a{request.attempt} with an etcd rendezvous)")
    if problems:
        raise ConfigError("StartShare for job " + repr(job) + " is malformed, so this node's "
                          "share was left as it was: " + "; ".join(problems))


def split_to_proto(split: dict[str, Any] | None) -> pb.StepSplit | None:
    """JobService.step_split -> StepSplit (None stays unset: no sampled step seen yet)."""
    if split is None:
        return None

    stages = [pb.StageSplit(
        stage=s["stage"], ranks=s["ranks"], step=s["step"], forward_s=s["forward"],
        backward_s=s["backward"], optimizer_s=s["optimizer"], p2p_wait_s=s["p2p_wait"],
        dp_reduce_s=s["dp_reduce"], data_s=s["data"], compute_s=s["compute_s"],
        step_s=s["step_s"], **_optional(bubble=s["bubble"],
                                         reduce_to_forward=s["reduce_to_forward"]))
        for s in split["stages"]]
    return pb.StepSplit(
        stages=stages, bubble_target=split["bubble_target"],
        reduce_to_forward_target=split["reduce_to_forward_target"],
        **_optional(bubble=split["bubble"], bubble_theoretical=split["bubble_theoretical"],
                    reduce_to_forward=split["reduce_to_forward"]))


def _optional(**fields: float | None) -> dict[str, float]:
    """proto3 `optional` fields: an unknown value is left unset, not sent as 0."""
    return {k: float(v) for k, v in fields.items() if v is not None}


def job_to_proto(job: Job, split: dict[str, Any] | None = None) -> pb.JobStatus:
    """A stored job as JobStatus. A job whose stored configuration this daemon cannot read
    (quarantined at start, see Store.quarantine_unreadable) is still answered: its spec holds
    the name and the stored text only, and its message says why."""
    try:
        cfg: JobConfig | None = JobConfig.model_validate_json(job.config_json)
    except ValueError:
        cfg = None
    if cfg is None:
        total, boundaries, source = 0, [], ""
        spec = pb.JobSpec(name=job.name, config_json=job.config_json)
    else:
        total = cfg.train.steps
        partition = current_partition(cfg, job.run_dir or None)
        boundaries, source = partition.boundaries, partition.source
        spec = pb.JobSpec(
            name=job.name, preset=cfg.preset or "", tp=cfg.parallel.tp, pp=cfg.parallel.pp,
            dp=cfg.parallel.dp, zero_stage=cfg.parallel.zero_stage, nnodes=cfg.launch.nnodes,
            total_steps=total, device=cfg.launch.device, n_params=cfg.model.n_params(),
            config_json=job.config_json)
    eta = (total - job.step) * job.step_time_s if job.step_time_s > 0 and cfg else -1.0
    return pb.JobStatus(
        spec=spec, state=cast("pb.JobState.ValueType", job.state.value),
        desired_state=cast("pb.JobState.ValueType", job.desired_state.value),
        step=job.step, loss=job.loss if job.loss is not None else math.nan,
        tokens_per_s=job.tokens_per_s, step_time_s=job.step_time_s,
        eta_s=eta if job.state.live else 0.0, restarts=job.restarts,
        last_checkpoint_step=job.last_ckpt_step, created_at=job.created_at,
        updated_at=job.updated_at, message=job.message, node=job.node, run_dir=job.run_dir,
        world_size=job.world_size, stage_boundaries=boundaries,
        partition_source=source, step_split=split_to_proto(split),
        memory_snapshot_step=job.memory_snapshot_step,
        restarts_in_a_row=restarts_in_a_row(job))


def plan_to_proto(pred: Prediction) -> pb.PartitionPlan:
    return pb.PartitionPlan(boundaries=pred.boundaries, stage_s=pred.stage_s,
                            slowest_s=pred.slowest_s, step_s=pred.step_s, bubble=pred.bubble,
                            stage_memory_bytes=pred.stage_memory_bytes)


def rebalance_to_proto(r: Rebalance) -> pb.RebalanceResponse:
    prop = r.proposal
    return pb.RebalanceResponse(
        current=plan_to_proto(prop.current), proposed=plan_to_proto(prop.proposed),
        improvement=prop.improvement, threshold=prop.threshold,
        micro_batches=prop.micro_batches, profile_step=r.profile_step,
        layers=[pb.LayerCost(layer=c.layer, forward_s=c.forward_s, backward_s=c.backward_s,
                             params=c.params, activation_bytes=c.activation_bytes)
                for c in r.layers],
        action=r.action, message=r.message, command_id=r.command_id,
        memory_limit_bytes=r.memory_limit_bytes or 0.0)


def event_to_proto(ev: Event) -> pb.Event:
    return pb.Event(
        seq=ev.seq, job=ev.job, time=ev.time, kind=ev.kind,
        from_state=cast("pb.JobState.ValueType", ev.from_state),
        to_state=cast("pb.JobState.ValueType", ev.to_state), step=ev.step, rank=ev.rank,
        node=ev.node, restart=ev.restart,
        cause=ev.cause, message=ev.message,
        loss=ev.loss if ev.loss is not None else math.nan,
        tokens_per_s=ev.tokens_per_s if ev.tokens_per_s is not None else 0.0,
        detail_json=json.dumps(ev.detail, default=str))


class ControlServicer(pb_grpc.ControlServicer):
    def __init__(self, service: JobService, shares: Shares, node: str,
                 peers: PeerClient | None = None, followed_watches_max: int = 24) -> None:
        """`followed_watches_max`: most WatchEvents with `follow` served at once; each holds
        an RPC thread until its client leaves, so it must stay below the server's threads."""
        self.service = service
        self.shares = shares
        self.node = node
        self.peers = peers
        self.started_at = time.time()
        self.followed_watches_max = followed_watches_max
        self._watch_slots = threading.BoundedSemaphore(followed_watches_max)
        # a checkpoint verify reads and hashes every file of every checkpoint (minutes on a
        # big store) in an RPC thread: VERIFIES_MAX at once, one per job
        self._verifying: set[str] = set()
        self._verifying_lock = threading.Lock()

    def _head(self, name: str) -> str | None:
        """The head daemon's address when `name` is not headed here but this node runs (or
        ran) a share of it; None to answer locally."""
        if self.peers is None or not name:
            return None
        if self.service.has(name):  # led here, unless another daemon took it over (etcd mode)
            return self.service.get(name).leader or None
        return self.shares.head_address(_name(name))

    def _forwarded(self, method: str, request: Any, answer: type[R]) -> R | None:
        """The head's answer (an `answer`) to `request` when the job is headed elsewhere, else
        None."""
        name = getattr(request, "name", "")
        head = self._head(name)
        if head is None:
            return None
        try:
            resp: R = self.peers.forward(head, method, request)  # type: ignore[union-attr]
        except PeerError as e:
            if not self.shares.etcd_led(_name(name)):
                raise
            raise HeadReplacingError(
                f"{e}: if that daemon is gone, a survivor takes the job over once its leader "
                f"lease ({LEASE_TTL_S} s) runs out; retry in a few seconds") from None
        return resp

    def StartJob(self, request: pb.StartJobRequest,
                 context: grpc.ServicerContext) -> pb.StartJobResponse:
        if not request.config_json:
            raise ConfigError("config_json is empty: send a JobConfig as JSON (ds3dctl start "
                              "builds it from a preset or a TOML file)")
        return pb.StartJobResponse(job=job_to_proto(self.service.start(request.config_json)))

    def PauseJob(self, request: pb.PauseJobRequest,
                 context: grpc.ServicerContext) -> pb.JobResponse:
        if (fwd := self._forwarded("PauseJob", request, pb.JobResponse)) is not None:
            return fwd
        return pb.JobResponse(job=job_to_proto(self.service.pause(_name(request.name),
                                                                  request.fast)))

    def ResumeJob(self, request: pb.ResumeJobRequest,
                  context: grpc.ServicerContext) -> pb.JobResponse:
        if (fwd := self._forwarded("ResumeJob", request, pb.JobResponse)) is not None:
            return fwd
        return pb.JobResponse(job=job_to_proto(self.service.resume(_name(request.name))))

    def StopJob(self, request: pb.StopJobRequest,
                context: grpc.ServicerContext) -> pb.JobResponse:
        if (fwd := self._forwarded("StopJob", request, pb.JobResponse)) is not None:
            return fwd
        return pb.JobResponse(job=job_to_proto(self.service.stop(_name(request.name),
                                                                 request.now)))

    def GetJob(self, request: pb.JobRef,
               context: grpc.ServicerContext) -> pb.JobResponse:
        if (fwd := self._forwarded("GetJob", request, pb.JobResponse)) is not None:
            return fwd
        name = _name(request.name)
        return pb.JobResponse(job=job_to_proto(self.service.get(name),
                                               self.service.step_split(name)))

    def ListJobs(self, request: pb.ListJobsRequest,
                 context: grpc.ServicerContext) -> pb.ListJobsResponse:
        size = job_pages.page_size(request.page_size)
        after = job_pages.decode_token(request.page_token, request.include_finished)
        local = [] if after is not None and after.shared else self.service.jobs_page(
            request.include_finished, None if after is None else after.seq,
            size + 1)  # one more: is there a next page
        candidates = [(job_pages.own_key(j.listed_seq, j.name),
                       job_to_proto(j, self.service.step_split(j.name))) for j in local]
        for shared in self._shared_jobs(request.include_finished):
            key = job_pages.shared_key(shared.spec.name)
            if after is None or key > after:
                candidates.append((key, shared))
        page, last = job_pages.take_page(candidates, lambda c: c[0], size,
                                         lambda c: c[1].ByteSize())
        token = "" if last is None else job_pages.encode_token(last, request.include_finished)
        return pb.ListJobsResponse(jobs=[job for _, job in page], next_page_token=token)

    def _shared_jobs(self, include_finished: bool) -> list[pb.JobStatus]:
        """Jobs headed by another daemon of which this node runs a share, as their heads
        answer (a head that does not answer: the job is left out and logged)."""
        jobs = []
        for name in self.shares.names():
            try:
                if self._head(name) is None:
                    continue
                answer = self._forwarded("GetJob", pb.JobRef(name=name), pb.JobResponse)
            except Ds3dError as e:
                log.info("shared job not listed", job=name, error=str(e))
                continue
            if answer is None:  # headed here after all (the share ended meanwhile)
                continue
            job = answer.job
            if include_finished or job.state not in _TERMINAL:
                jobs.append(job)
        return jobs

    def WatchEvents(self, request: pb.WatchEventsRequest,
                    context: grpc.ServicerContext) -> Iterator[pb.Event]:
        name = _name(request.name) if request.name else ""
        if request.after_seq < 0 or request.step_every < 0:
            raise ConfigError("after_seq and step_every must be 0 or more")
        if request.follow and not self._watch_slots.acquire(blocking=False):
            raise LongCallLimitError(
                f"{self.followed_watches_max} event watches that follow are open on this "
                "daemon, the most it serves at once (so that every other call keeps an "
                "answer); end one (a `ds3dctl events --follow` left running?), or watch "
                "without follow and again later")
        try:
            for ev in self.service.events(name, request.after_seq, request.follow,
                                          list(request.kinds), request.step_every,
                                          context.is_active):
                yield event_to_proto(ev)
        finally:
            if request.follow:
                self._watch_slots.release()

    def ListCheckpoints(self, request: pb.ListCheckpointsRequest,
                        context: grpc.ServicerContext) -> pb.ListCheckpointsResponse:
        fwd = self._forwarded("ListCheckpoints", request, pb.ListCheckpointsResponse)
        if fwd is not None:
            return fwd
        name = _name(request.name)
        if request.verify:
            with self._verification(name):
                rows, changes = self.service.checkpoints(name, verify=True)
        else:
            rows, changes = self.service.checkpoints(name)
        return pb.ListCheckpointsResponse(checkpoints=[
            pb.Checkpoint(step=c.step, phase=c.phase, path=c.path, time=c.time,
                          blocked_s=c.blocked_s, present=self.service.checkpoint_present(name, c),
                          detail=c.detail)
            for c in rows], changes=changes)

    @contextlib.contextmanager
    def _verification(self, name: str) -> Iterator[None]:
        """A slot for one checkpoint verify of job `name`, or LongCallLimitError."""
        with self._verifying_lock:
            if name in self._verifying:
                raise LongCallLimitError(
                    f"a verify of {name}'s checkpoints is under way; its changes are in the "
                    f"index when it ends: `ds3dctl checkpoints {name}` then shows them")
            if len(self._verifying) >= VERIFIES_MAX:
                raise LongCallLimitError(
                    f"{VERIFIES_MAX} checkpoint verifies run on this daemon, the most it serves "
                    "at once (so that every other call keeps an answer); try again when one "
                    "has ended")
            self._verifying.add(name)
        try:
            yield
        finally:
            with self._verifying_lock:
                self._verifying.discard(name)

    def SaveCheckpoint(self, request: pb.SaveCheckpointRequest,
                       context: grpc.ServicerContext) -> pb.SaveCheckpointResponse:
        fwd = self._forwarded("SaveCheckpoint", request, pb.SaveCheckpointResponse)
        if fwd is not None:
            return fwd
        return pb.SaveCheckpointResponse(command_id=self.service.save(_name(request.name)))

    def Rollback(self, request: pb.RollbackRequest,
                 context: grpc.ServicerContext) -> pb.JobResponse:
        if (fwd := self._forwarded("Rollback", request, pb.JobResponse)) is not None:
            return fwd
        return pb.JobResponse(job=job_to_proto(self.service.rollback(_name(request.name),
                                                                     request.step)))

    def GetLogs(self, request: pb.GetLogsRequest,
                context: grpc.ServicerContext) -> pb.GetLogsResponse:
        if request.tail_lines < 0:
            raise ConfigError(f"tail_lines={request.tail_lines}: use 0 (default 200) or more")
        files = self.service.logs(_name(request.name), request.tail_lines, request.source)
        return pb.GetLogsResponse(files=[pb.LogFile(path=f.path, text=f.text, size=f.size)
                                         for f in files])

    def InjectFault(self, request: pb.InjectFaultRequest,
                    context: grpc.ServicerContext) -> pb.InjectFaultResponse:
        if (fwd := self._forwarded("InjectFault", request, pb.InjectFaultResponse)) is not None:
            return fwd
        inj = self.service.inject(_name(request.name), request.kind, request.rank,
                                  request.at_step)
        return pb.InjectFaultResponse(id=inj.id, at_step=inj.at_step, path=str(inj.path))

    def Rebalance(self, request: pb.RebalanceRequest,
                  context: grpc.ServicerContext) -> pb.RebalanceResponse:
        if (fwd := self._forwarded("Rebalance", request, pb.RebalanceResponse)) is not None:
            return fwd
        return rebalance_to_proto(self.service.rebalance(_name(request.name), request.dry_run))

    # ---- node to node ----

    def ShareControl(self, request: pb.ShareControlRequest,
                     context: grpc.ServicerContext) -> pb.ShareControlResponse:
        return pb.ShareControlResponse(present=self.shares.control(
            _name(request.name), request.file, request.text, request.leader_token))

    def PullReports(self, request: pb.PullReportsRequest,
                    context: grpc.ServicerContext) -> pb.PullReportsResponse:
        if request.max_bytes < 0:
            raise ConfigError("max_bytes must be 0 (default) or more")
        chunks = self.shares.pull(_name(request.name), dict(request.offsets), request.max_bytes)
        return pb.PullReportsResponse(node=self.node, present=chunks is not None,
                                      chunks=chunks or [])

    def StartShare(self, request: pb.StartShareRequest,
                   context: grpc.ServicerContext) -> pb.StartShareResponse:
        if request.head_node == self.node:
            raise ConfigError(
                f"StartShare from head node {request.head_node!r} reached a daemon of the same "
                "node name: either launch.hosts lists the head twice, or two daemons share a "
                "--node-name (give each daemon its own)")
        cfg = parse_config(request.config_json, from_head=True)  # as StartJob, before any process
        check_share_request(request, cfg.name)  # before the job's running agent is replaced
        handle = self.shares.start(request)
        return pb.StartShareResponse(node=self.node, agent_pid=handle.ref.pid)

    def StopShare(self, request: pb.StopShareRequest,
                  context: grpc.ServicerContext) -> pb.StopShareResponse:
        return pb.StopShareResponse(was_running=self.shares.stop(
            _name(request.name), request.now, request.leader_token))

    def NodeStatus(self, request: pb.NodeStatusRequest,
                   context: grpc.ServicerContext) -> pb.NodeStatusResponse:
        return pb.NodeStatusResponse(node=self.node, version=VERSION,
                                     started_at=self.started_at, shares=self.shares.status())
