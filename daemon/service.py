"""The daemon's operations on jobs, in domain terms (no protobuf here; api.py converts).

Each request is validated, checked against the state table, and stored as intent (desired state,
pending worker command, rollback step) in one transaction; then the job's supervisor is woken to
act on it. The supervisor is the only writer of job states, so a request never races the loop
that watches the workers.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ds3d.checkpoints.identity import new_job_id, write_local_job_id
from ds3d.trainer.config import JobConfig, validate_for_daemon, validate_job, validate_tokenizer
from ds3d.trainer.errors import ConfigError, NotFoundError, StateError
from ds3d.trainer.kinds import EventKind, FaultKind
from ds3d.trainer.memory_model import NodeResources
from ds3d.trainer.partition import (
    CALIBRATION_STEPS,
    LayerCost,
    Proposal,
    current_partition,
    fmt_boundaries,
    memory_model,
    merge_profile_records,
    propose,
)

from .ckpt_index import reconcile
from .commands import Action, Command
from .errors import quoted
from .fit_check import check_fit
from .jobdir import JobDir
from .peers import PeerClient, check_peer_address
from .preflight import preflight
from .states import LIVE, TERMINAL, JobState, check_action
from .step_analysis import BUBBLE_TARGET, REDUCE_TO_FORWARD_TARGET
from .store import CheckpointRow, Event, Job, Store
from .supervisors import Supervisors

LOG_TAIL_MAX_BYTES = 256 * 1024
# one GetLogs answer: below grpc's default 4 MiB a client receives (a job of many ranks and
# restarts has hundreds of log files; the whole answer used to fail with RESOURCE_EXHAUSTED)
LOGS_ANSWER_MAX_BYTES = 3 << 20


@dataclass(frozen=True)
class Injection:
    id: int
    at_step: int
    path: Path


@dataclass(frozen=True)
class Rebalance:
    """The current and the measured-best pipeline partition of a job (see partition.py)."""

    proposal: Proposal
    layers: list[LayerCost]
    profile_step: int
    action: str  # "dry_run", "scheduled", "unchanged"
    message: str
    command_id: int = 0
    memory_limit_bytes: float | None = None


@dataclass(frozen=True)
class LogTail:
    path: str
    text: str
    size: int


def parse_config(config_json: str, from_head: bool = False) -> JobConfig:
    """Request JSON -> validated JobConfig; every problem named with its field (ConfigError).
    The one check of StartJob and StartShare (`from_head`), made before anything is created."""
    cfg = JobConfig.parse_json(config_json, "request")
    validate_job(cfg)
    # a DeepSpeed JSON must already be translated into the job's fields (ds3dctl does it), and
    # the DeepSpeed config the workers will get must pass DeepSpeed's own parser
    from ds3d.trainer.ds_config import check_with_deepspeed
    from ds3d.trainer.ds_config_import import verify_job_matches

    if not from_head:  # the head read them; they need not exist on the other nodes
        verify_job_matches(cfg)
        validate_tokenizer(cfg)
    check_with_deepspeed(cfg)
    validate_for_daemon(cfg)
    return cfg


_EVENT_KINDS = frozenset(EventKind)


def event_kinds(kinds: list[str]) -> list[EventKind]:
    """The kinds a WatchEvents request asks for, each checked against the registry."""
    unknown = [k for k in kinds if k not in _EVENT_KINDS]
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ConfigError(f"event kind(s) {', '.join(map(quoted, unknown[:5]))}{more} unknown; "
                          f"use one of {', '.join(EventKind)}")
    return [EventKind(k) for k in kinds]


def stored_config_problem(config_json: str) -> str | None:
    """Why this daemon cannot read a stored job's configuration (one line), or None."""
    try:
        JobConfig.parse_json(config_json, "stored job")
    except ConfigError as e:
        return " ".join(str(e).split())
    return None


T = TypeVar("T")


def _one_command_at_a_time(method: Callable[..., T]) -> Callable[..., T]:
    """A job's control requests are decided one at a time: each reads the job, checks that the
    action is allowed, then records it, and two interleaved (a stop and a resume from two
    clients) would each pass their check against the state before the other's."""
    @functools.wraps(method)
    def serialized(self: JobService, name: str, *args: Any, **kwargs: Any) -> T:
        with self._guard:
            lock = self._job_locks.setdefault(name, threading.Lock())
        with lock:
            return method(self, name, *args, **kwargs)
    return serialized


class JobService:
    def __init__(self, store: Store, supervisors: Supervisors, jobs_root: Path,
                 node: str, peers: PeerClient | None = None,
                 enable_fault_injection: bool = False,
                 resources: NodeResources | None = None) -> None:
        self.store = store
        self.supervisors = supervisors
        self.jobs_root = jobs_root
        self.node = node
        self.peers = peers
        self.enable_fault_injection = enable_fault_injection
        self.resources = resources  # this node's GPUs and memory, for the fit check
        self._guard = threading.Lock()
        self._job_locks: dict[str, threading.Lock] = {}  # _one_command_at_a_time

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, config_json: str) -> Job:
        cfg = parse_config(config_json)
        if self.resources is not None:  # before any side effect (fit_check.py)
            check_fit(cfg, self.resources)
        if cfg.launch.nnodes > 1:
            for address in cfg.launch.hosts[1:]:
                check_peer_address(address, self.peers.tls if self.peers else None)
        self.store.check_name_free(cfg.name)
        jobdir = JobDir(self.jobs_root, cfg.name)
        job_id = new_job_id()  # its store prefix and manifests name it (checkpoints/identity)
        # last: its store check may create the job's prefix in the store
        preflight(cfg, job_id=job_id, run_dir=jobdir.path)
        job = self.store.create_job(cfg.name, cfg.dump_json(), self.node, str(jobdir.path),
                                    job_id=job_id)
        jobdir.create(cfg.dump_json())
        write_local_job_id(jobdir.path, job_id)
        self.supervisors.poke(cfg.name)
        return job

    @_one_command_at_a_time
    def pause(self, name: str, fast: bool = False) -> Job:
        job = self.store.get_job(name)
        check_action(name, "pause", job.state)
        self._require_desired_running(job, "pause")
        return self._command(job, Command(Action.PAUSE, fast=fast), JobState.PAUSED,
                             "pause requested" + (" (fast)" if fast else ""))

    @_one_command_at_a_time
    def resume(self, name: str) -> Job:
        job = self.store.get_job(name)
        if job.desired_state is JobState.PAUSED and job.state in LIVE - {JobState.PAUSED}:
            # `pause` returns once the request is stored; the workers save, then exit
            raise StateError(f"cannot resume job {name!r} yet: it is being paused (state "
                             f"{job.state.name}: the workers save a checkpoint, then exit); "
                             f"resume once `ds3dctl status {name}` shows PAUSED")
        if job.desired_state is JobState.STOPPED and job.state in LIVE:
            # a resume would cancel the stop a client asked for, and answer OK
            raise StateError(f"cannot resume job {name!r}: it is being stopped (state "
                             f"{job.state.name}); a stop is final")
        check_action(name, "resume", job.state)
        job = self.store.record(name, EventKind.REQUEST, "resume requested",
                                desired_state=JobState.RUNNING)
        self.supervisors.poke(name)
        return job

    @_one_command_at_a_time
    def stop(self, name: str, now: bool = False) -> Job:
        job = self.store.get_job(name)
        check_action(name, "stop", job.state)
        if job.desired_state is JobState.STOPPED and \
                not (now and Command.decode(job.command_action) == Command(Action.STOP)):
            return job  # already stopping; stop after stop is a no-op, stop --now escalates
        return self._command(job, Command(Action.STOP_NOW if now else Action.STOP),
                             JobState.STOPPED,
                             "stop requested" + (" (now, no checkpoint)" if now else ""))

    @_one_command_at_a_time
    def save(self, name: str) -> int:
        job = self.store.get_job(name)
        check_action(name, "save", job.state)
        self._require_desired_running(job, "save")
        job = self._command(job, Command(Action.SAVE), JobState.RUNNING, "checkpoint requested")
        return job.command_id

    @_one_command_at_a_time
    def rollback(self, name: str, step: int) -> Job:
        job = self.store.get_job(name)
        check_action(name, "rollback", job.state)
        self._require_desired_running(job, "roll back", allow_paused=True)
        if step < 0:
            raise ConfigError(f"rollback step={step}: a step is 0 or more")
        usable = [c.step for c in self.checkpoints(name)[0]
                  if c.phase in ("saved", "committed") and self.checkpoint_present(name, c)]
        if step not in usable:
            have = ", ".join(map(str, usable)) or "none yet (`ds3dctl save JOB` makes one)"
            raise NotFoundError(f"job {name!r} has no checkpoint at step {step}; "
                                f"checkpoints: {have}")
        job = self.store.request_rollback(name, step, f"rollback to step {step} requested")
        self.supervisors.poke(name)
        return job

    def inject(self, name: str, kind: str, rank: int, at_step: int) -> Injection:
        """Drills: schedules a fault on one rank by writing control/inject.json on every node
        of the job (the workers act on it; see jobdir.py). Refused unless the daemon was started
        with --enable-fault-injection."""
        if not self.enable_fault_injection:
            raise StateError("fault injection is disabled on this daemon; restart ds3dd with "
                             "--enable-fault-injection to allow it (drills only)")
        try:
            fault = FaultKind(kind)
        except ValueError:
            raise ConfigError(f"fault kind {kind!r} is unknown; use one of "
                              f"{', '.join(FaultKind)}") from None
        job = self.store.get_job(name)
        check_action(name, "inject", job.state)
        world = job.world_size or JobConfig.model_validate_json(
            job.config_json).parallel.world_size
        if not 0 <= rank < world:
            raise ConfigError(f"rank={rank}: job {name!r} has ranks 0..{world - 1}")
        if at_step < 0:
            raise ConfigError(f"at_step={at_step}: use a step number, or 0 for the next step")
        step = at_step or job.step + 1
        jobdir = JobDir(self.jobs_root, name)
        previous = jobdir.inject()
        inject_id = int(previous.get("id", 0)) + 1 if previous else 1
        text = jobdir.write_inject(inject_id, fault, rank, step)
        self.store.record(name, EventKind.INJECT, f"fault injection {inject_id}: {kind} on rank "
                          f"{rank} at step {step}", rank=rank, cause=kind,
                          detail={"id": inject_id, "kind": kind, "rank": rank, "at_step": step})
        self.supervisors.forward_control(name, "inject.json", text)
        return Injection(inject_id, step, jobdir.inject_file)

    def rebalance(self, name: str, dry_run: bool) -> Rebalance:
        """Measured costs (the workers' `profile` records, from every node) -> the best
        partition beside the current one; without `dry_run` the workers apply it at the next
        step boundary (checkpoint, partition.json, restart). Without a profile, a RUNNING job is
        asked to profile its next steps and the caller is told to ask again."""
        job = self.store.get_job(name)
        cfg = JobConfig.model_validate_json(job.config_json)
        p = cfg.parallel
        if p.pp < 2 or p.zero_stage >= 2:
            raise StateError(f"job {name!r} has one pipeline stage (parallel.pp={p.pp}); there is "
                             "nothing to re-partition")
        records = []
        after = 0
        while batch := self.store.events(job=name, after_seq=after, kinds=[EventKind.PROFILE],
                                         limit=500):
            records += [ev.detail for ev in batch]
            after = batch[-1].seq
        merged = merge_profile_records(records, cfg.model.n_layers)
        if merged is None:
            raise StateError(self._request_profile(job, cfg))
        current = current_partition(cfg, job.run_dir)
        memory = memory_model(merged)
        proposal = propose(merged["layers"], current.boundaries, merged["micro_batches"],
                           p.partition_threshold, memory)
        cur, new = proposal.current, proposal.proposed
        gain = f"{proposal.improvement:.1%}"
        action, cid = "dry_run", 0
        if not proposal.worth_it:
            message = (f"the current partition {fmt_boundaries(cur.boundaries)} is within "
                       f"{p.partition_threshold:.0%} of the best measured one "
                       f"({fmt_boundaries(new.boundaries)}, {gain} faster slowest stage): "
                       "nothing to change")
            if not dry_run:
                action = "unchanged"
        elif dry_run:
            message = (f"dry run: {fmt_boundaries(new.boundaries)} would lower the slowest stage "
                       f"by {gain}; `ds3dctl rebalance {name}` applies it")
        else:
            if job.state is not JobState.RUNNING:
                raise StateError(f"cannot rebalance job {name!r}: it is {job.state.name}; a new "
                                 "partition is applied by running workers at a step boundary "
                                 "(resume the job first), or look with --dry-run")
            self._require_desired_running(job, "rebalance")
            job = self._command(job, Command.repartition(new.boundaries),
                                JobState.RUNNING, f"rebalance requested: stages "
                                f"{fmt_boundaries(cur.boundaries)} -> "
                                f"{fmt_boundaries(new.boundaries)} ({gain} faster slowest stage)")
            action, cid = "scheduled", job.command_id
            message = (f"scheduled (command {cid}): at the next step boundary the workers save a "
                       f"checkpoint and restart on {fmt_boundaries(new.boundaries)}")
        return Rebalance(proposal, merged["layers"], merged["step"], action, message, cid,
                         merged.get("memory_limit_bytes"))

    def _request_profile(self, job: Job, cfg: JobConfig) -> str:
        """Why there is no answer yet, after asking a running job's workers for a profile."""
        name, steps = job.name, CALIBRATION_STEPS + cfg.parallel.partition_profile_steps
        if job.state is JobState.RUNNING and job.desired_state is JobState.RUNNING:
            pending = Command.decode(job.command_action) == Command(Action.PROFILE) and \
                job.command_acked < job.command_id
            if not pending:
                job = self._command(job, Command(Action.PROFILE), JobState.RUNNING,
                                    "layer profile requested (ds3dctl rebalance)")
            return (f"job {name!r} has no layer profile yet; its workers now time every layer "
                    f"over the next {steps} steps (command {job.command_id}): run `ds3dctl "
                    f"rebalance {name} --dry-run` again once `ds3dctl events {name} --kind "
                    "profile` lists them")
        if job.state in TERMINAL:
            return (f"job {name!r} has no layer profile and is {job.state.name}: layers are "
                    "profiled by running workers; a new job of the same model profiles while "
                    "it trains (parallel.partition_method = \"measured\" profiles and splits "
                    "by itself, or run rebalance on it)")
        return (f"job {name!r} has no layer profile and is {job.state.name}: layers are profiled "
                "by running workers; resume it (with parallel.partition_method = "
                "\"measured\" it profiles by itself) and run rebalance again")

    # ---- queries -----------------------------------------------------------------------------

    def get(self, name: str) -> Job:
        return self.store.get_job(name)

    def step_split(self, name: str) -> dict[str, Any] | None:
        """Where the newest sampled step's time went, per stage, with the overall bubble and
        reduce/forward ratio beside the targets the diagnoses use (None before a sample)."""
        analysis = self.supervisors.analysis(name)
        if analysis is None or not (stages := analysis.per_stage()):
            return None
        bubble = analysis.bubble()
        return {"stages": stages, "bubble": bubble[0] if bubble else None,
                "bubble_theoretical": bubble[1] if bubble else None,
                "reduce_to_forward": analysis.reduce_to_forward(),
                "bubble_target": BUBBLE_TARGET,
                "reduce_to_forward_target": REDUCE_TO_FORWARD_TARGET}

    def has(self, name: str) -> bool:
        """The job is headed by this daemon (stored here)."""
        return self.store.has_job(name)

    def jobs_page(self, include_finished: bool, after_seq: int | None,
                  limit: int) -> list[Job]:
        """At most `limit` jobs headed here, oldest first, after the one numbered `after_seq`
        in listings (job_pages.py): never the whole store in one answer."""
        return self.store.list_jobs_page(after_seq, limit, include_finished)

    def checkpoints(self, name: str, verify: bool = False) -> tuple[list[CheckpointRow],
                                                                    list[str]]:
        """The index, and with `verify` first reconciled with the store, every file's size and
        sha256 checked (daemon/ckpt_index.py): rows, and one line per change it made."""
        self.store.get_job(name)
        changes: list[str] = []
        if verify:
            changes = reconcile(self.store, self.supervisors.ctx.metrics, name,
                                checksums=True).lines()
        return self.store.checkpoints(name), changes

    def checkpoint_present(self, name: str, row: CheckpointRow) -> bool:
        if not row.path or "://" in row.path:
            return False
        p = Path(row.path)
        if not p.is_absolute():
            p = JobDir(self.jobs_root, name).ckpt / p
        return p.exists()

    def events(self, name: str, after_seq: int, follow: bool, kinds: list[str],
               step_every: int, is_active: Callable[[], bool]) -> Iterator[Event]:
        """Stored events in order; with `follow`, new ones as they are committed, until the job
        (or, for all jobs, the client) is done. An unknown kind is refused (it would match
        nothing, forever)."""
        wanted = event_kinds(kinds)
        if name:
            self.store.get_job(name)
        last = after_seq
        every = max(1, step_every)
        while is_active():
            batch = self.store.events(job=name, after_seq=last, kinds=wanted, limit=500)
            for ev in batch:
                last = ev.seq
                if ev.kind == "step" and every > 1 and ev.step % every:
                    continue
                yield ev
            if len(batch) == 500:
                continue
            if not follow:
                return
            if name and self.store.get_job(name).state in TERMINAL and \
                    not self.store.events(job=name, after_seq=last, kinds=wanted, limit=1):
                return
            self.store.wait_for_change(1.0)

    def logs(self, name: str, tail_lines: int, source: str) -> list[LogTail]:
        self.store.get_job(name)
        root = JobDir(self.jobs_root, name).logs
        files = sorted(p for p in root.rglob("*") if p.is_file())
        if source == "agent":
            files = [p for p in files if p.name == "agent.log"]
        elif source.startswith("rank:"):
            r = source.split(":", 1)[1]
            if not (r.isascii() and r.isdigit()):
                raise ConfigError(f"logs source {quoted(source)}: use agent, rank:N or nothing")
            ranks = sorted({int(p.parent.name) for p in files if p.parent.name.isdigit()})
            files = [p for p in files if p.parent.name == r]
            if not files and ranks:  # not "no logs yet": this rank has none at all
                shown = r if len(r) <= 20 else f"{r[:20]}... ({len(r)} digits)"
                raise NotFoundError(
                    f"no logs of local rank {shown} on node {self.node}; its worker logs are of "
                    f"local ranks {', '.join(map(str, ranks))} (rank:N is the rank on this "
                    "node, not the global rank)")
        elif source:
            raise ConfigError(f"logs source {quoted(source)}: use agent, rank:N or nothing")
        n = tail_lines if tail_lines > 0 else 200
        tails: dict[Path, LogTail] = {}
        room = LOGS_ANSWER_MAX_BYTES
        # newest first: past the answer's budget, the oldest files are listed without text
        for p in sorted(files, key=lambda f: f.stat().st_mtime, reverse=True):
            size = p.stat().st_size
            if room > 0:
                take = min(LOG_TAIL_MAX_BYTES, room)
                with open(p, "rb") as fh:
                    fh.seek(max(0, size - take))
                    text = "\n".join(fh.read().decode("utf-8", "replace").splitlines()[-n:])
                # the file that spends the last of the budget ends it
                room = 0 if take == room and size > take else room - len(text.encode())
            else:
                text = (f"[ds3d: not sent; this answer is capped at {LOGS_ANSWER_MAX_BYTES} bytes "
                        "and newer files came first: ask for fewer lines or one source]"
                        if size else "")
            tails[p] = LogTail(str(p.relative_to(root)), text, size)
        return [tails[p] for p in files]

    # ---- internals ---------------------------------------------------------------------------

    @staticmethod
    def _require_desired_running(job: Job, what: str, allow_paused: bool = False) -> None:
        if job.desired_state is JobState.RUNNING:
            return
        if allow_paused and job.desired_state is JobState.PAUSED and \
                job.state is JobState.PAUSED:
            return
        raise StateError(f"cannot {what} job {job.name!r}: it is being "
                         f"{'paused' if job.desired_state is JobState.PAUSED else 'stopped'} "
                         f"(state {job.state.name}); wait for that to finish")

    def _command(self, job: Job, command: Command, desired: JobState, message: str) -> Job:
        """Stores the intent (desired state + next command id) with its event; the supervisor
        writes the command file (and re-writes it after a daemon crash)."""
        cid, action = job.command_id + 1, command.encode()
        job = self.store.record(job.name, EventKind.COMMAND, message, desired_state=desired,
                                command_id=cid, command_action=action,
                                detail={"id": cid, "action": action, "time": time.time()})
        self.supervisors.poke(job.name)
        return job
