"""One supervisor per job on its head node: a short loop of monitor -> detect -> decide -> act.

The supervisor is the only writer of a job's state. RPCs record *intent* (desired state, a
pending worker command, a rollback step) in the store and wake the supervisor; each tick reads
the stored job, so an intent stored before a daemon crash is carried out after the restart.

    tick:
        (multi-node) pull the other nodes' report records into reports/nodes/, re-send control
                     files a node missed
        agent_exit = agent status (before reading reports: a worker writes `done` before its
                     agent exits, so reading after seeing the exit never misses it)
        obs        = new report records -> events + offsets (one transaction)
        incidents  = faults whose workers train again -> one `recovered` event each, with
                     time to detect, time to recover, steps lost (daemon/incidents.py)
        faults     = [d.check(job, obs, agent_exit) for d in detectors]
        handler    = handler_for(state, requested state, rollback?) (daemon/decisions.py):
                     WIND_DOWN | ROLLBACK | START | BRING_UP | SUPERVISE, one method each
        handler(Tick(job, obs, agent_exit, faults))

Every transition goes through the store (table-checked, intent first). Detectors and the restart
policy are objects passed in, so a new fault needs a new detector, not a change to this loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ds3d.checkpoints.disk_space import is_disk_full
from ds3d.checkpoints.node_memory import remove_job_folder
from ds3d.trainer.config import JobConfig
from ds3d.trainer.kinds import DoneReason, EventKind, RecordKind

from .backlog_upload import MAX_RETRY_S, BacklogUpload, local_backlog
from .ckpt_index import IndexReconciler
from .commands import Action, Command
from .decisions import END_STATES, Handler, done_reason, handler_for
from .detectors import Detector, Fault
from .disk import DiskWatch
from .failure_history import FailureHistory
from .group_failures import GroupFailures
from .incidents import Incident, IncidentClock
from .job_detectors import DetectorFactory
from .job_leadership import FailoverClient, Leadership, job_key
from .job_metrics import JobMetrics
from .jobdir import JobDir
from .launcher import AgentHandle, Launcher, kill_strays
from .logging import get_logger
from .metrics import Metrics
from .multinode import JobNodes
from .peers import PeerClient, PeerError
from .policies import RestartPolicy, counted_restarts, restart_policy_for, restarts_in_a_row
from .procs import ProcessRef
from .rendezvous import etcd_endpoint, rendezvous_run_id, start_store
from .reports import Observation, ReportTail
from .semaphores import release as release_semaphores
from .stacks import StackDump, dump_stacks, suspects
from .states import TERMINAL, JobState
from .step_analysis import StepAnalysis
from .store import Job, Store
from .tick_errors import TickErrors

REJOIN_COMMAND_WAIT_S = 60.0  # a command the workers never acknowledge does not block a rejoin


@dataclass
class SupervisorContext:
    """What all supervisors of one daemon share; the detectors (built per job) and the
    restart policy are passed in by server.py."""

    store: Store
    launcher: Launcher
    metrics: Metrics
    jobs_root: Path
    node: str
    detectors: DetectorFactory  # daemon/job_detectors.py standard_detectors(...)
    restart_policy: Callable[[JobConfig], RestartPolicy] = restart_policy_for
    rdzv_host: str = "127.0.0.1"
    peers: PeerClient | None = None
    interval_s: float = 0.5
    stop_now_grace_s: float = 5.0
    peer_finish_timeout_s: float = 120.0
    backlog_retry_max_s: float = MAX_RETRY_S  # ds3dd --backlog-retry-max
    address: str = ""  # this daemon's gRPC address (its name as an etcd-mode job's leader)
    # etcd-mode jobs taken over by this daemon: the lease it already holds, by job name
    leaderships: dict[str, Leadership] = field(default_factory=dict)


@dataclass(frozen=True)
class Tick:
    """What one pass saw, handed to the handler chosen for it: the stored job, the new report
    records, the agent's exit code (None while it runs or when there is none), the faults the
    detectors found, and whether an agent of this daemon runs."""

    job: Job
    obs: Observation
    agent_exit: int | None
    faults: list[Fault]
    agent_running: bool


class JobSupervisor:
    def __init__(self, name: str, ctx: SupervisorContext) -> None:
        self.name = name
        self.ctx = ctx
        self.store = ctx.store
        self.jobdir = JobDir(ctx.jobs_root, name)
        self._held_config: tuple[str, str, JobConfig] | None = None  # see _config
        local = self._config(self.store.get_job(name)).checkpoint.local_dir
        self.tail = ReportTail(ctx.store, self.jobdir, Path(local) if local else None)
        self.analysis = StepAnalysis()
        self.detectors: list[Detector] = ctx.detectors(name, ctx.store, self.analysis)
        self.log = get_logger("ds3d.supervisor", job=name)
        # full disks (state dir, job dir, local tier) diagnosed before anything writes
        self.disk = DiskWatch(ctx.store, name, ctx.jobs_root.parent, self._config)
        self.tick_errors = TickErrors(
            ctx.store, name, self.log,
            lambda: ctx.metrics.faults.labels(name, "supervisor_error").inc())
        self.wake = threading.Event()
        self.agent: AgentHandle | None = None
        self._seen_group_restarts: set[tuple[int, int]] = set()
        self.nodes = JobNodes(name, self.jobdir, ctx.store, ctx.metrics, ctx.peers, ctx.node,
                              ctx.peer_finish_timeout_s, self._config)
        self._handlers: dict[Handler, Callable[[Tick], None]] = {
            Handler.WIND_DOWN: self._wind_down, Handler.ROLLBACK: self._rollback,
            Handler.START: self._start, Handler.BRING_UP: self._bring_up,
            Handler.SUPERVISE: self._supervise}
        job = self.store.get_job(name)
        self.exported = JobMetrics(ctx.metrics, name, self.analysis)
        self.incidents = IncidentClock.resumed(job.run_dir, job.step)  # after a restart too
        # the checkpoint index against the store: at the first tick (a daemon (re)start), and
        # after trouble
        self.index = IndexReconciler(ctx.store, ctx.metrics, name)
        # asked after the first tick has read the reports written meanwhile: their events come
        # first, and the store's verdict is not overwritten by the replay of older reports
        self._reconcile_due: str | None = "the daemon started supervising the job"
        self.failures = FailureHistory(ctx.store, name)
        self.group_failures = GroupFailures(ctx.store, ctx.metrics, name, self.jobdir, self.log)
        self._world = job.world_size  # processes of the running group; 0 before the first start
        # checkpoints the exited workers left local-complete but not durable (_durable_first)
        self.backlog: BacklogUpload | None = None
        adopted = ctx.leaderships.pop(name, None)  # taken over: the record is its predecessor's
        self.leadership = adopted or self._new_leadership(job)
        self._checked_term = adopted.lease.term.token if adopted and adopted.lease.term else 0
        if self.leadership is not None:
            self.nodes.leader_token = self.leadership.token
        if job.agent_pid:
            self.agent = Launcher.attach(self.jobdir.path, job.attempt, job.agent_pid,
                                         job.agent_started)
            self.log.info("reattached", pid=job.agent_pid, alive=self.agent.poll() is None)

    # ---- loop --------------------------------------------------------------------------------

    def run(self, stopping: threading.Event) -> None:
        """Ticks until the job is terminal or the daemon stops. A bug in one tick is logged and
        retried on the next tick; it never ends supervision of the job."""
        while not stopping.is_set():
            try:
                if self.tick():
                    return
                self.tick_errors.succeeded()
            except Exception as exc:
                if is_disk_full(exc):  # diagnosed by self.disk; retried once there is room
                    self.disk.write_failed(exc)
                else:
                    self.tick_errors.failed(exc)
            self.wake.wait(self.ctx.interval_s)
            self.wake.clear()
        if self.backlog is not None:  # the daemon stops: its successor resumes the backlog
            self.backlog.close()

    def tick(self) -> bool:
        """One pass; True once the job is terminal and cleaned up, or led by another daemon."""
        if self.leadership is not None and not self._lead():
            return self.store.get_job(self.name).leader != ""
        agent_exit = self.agent.poll() if self.agent is not None else None
        self.disk.tick(self.store.get_job(self.name))
        self.nodes.pull_reports(self.store.get_job(self.name))
        self.group_failures.record(self.store.get_job(self.name))  # before the new `start`
        obs = self.tail.poll()
        job = self.store.get_job(self.name)
        agent_restart = self._count_group_restarts(job, obs)
        for incident in self.incidents.observe(obs.records, agent_cause=agent_restart):
            self._recovered(incident)
        self.index.observe(obs.kinds(RecordKind.CHECKPOINT))
        if self._reconcile_due is not None:
            self.index.request(self._reconcile_due)
            self._reconcile_due = None
        if any(r.get("phase") == "rolled_back" for r in obs.kinds(RecordKind.CHECKPOINT)):
            self.nodes.forward_control("restore.json", "", local=True)  # read on rank 0's node
        self._note_store_wait(job, obs)
        faults = [f for d in self.detectors if (f := d.check(job, obs, agent_exit)) is not None]
        if self.disk.blocking():  # the workers train on; their reports wait for room
            faults = [f for f in faults if f.cause not in ("hang", "startup_timeout")]
        self._decide_and_act(job, obs, agent_exit, faults)
        job = self.store.get_job(self.name)
        self._welcome_back(job)
        self.exported.export(job, obs)
        if self.leadership is not None and \
                not self.leadership.publish(job, self.store, force=job.state in TERMINAL):
            self._step_down(self.leadership.holder_now() or self.leadership.deposed_by)
            return True
        if job.state.live:  # checkpoint.interval = "auto" needs the failure rate
            self.failures.publish(
                lambda file, text: self.nodes.forward_control(file, text, local=True))
        if job.state in TERMINAL:
            self._cleanup(job)
            if self.leadership is not None:
                self.leadership.release()  # after the record says terminal: nobody takes over
            return True
        return False

    # ---- leadership of an etcd-mode job (daemon/job_leadership.py) -------------------------

    def _new_leadership(self, job: Job) -> Leadership | None:
        """The lease this daemon must hold to supervise the job: multi-node jobs whose
        rendezvous is in etcd only (the default c10d mode has one fixed head)."""
        cfg = self._config(job)
        if cfg.launch.nnodes <= 1 or not cfg.launch.etcd_endpoints or not job.job_id:
            return None
        return Leadership(FailoverClient(cfg.launch.etcd_endpoints),
                          job_key(job.name, job.job_id), self.ctx.address or self.ctx.node)

    def _lead(self) -> bool:
        """True while this daemon holds the job's lease. Otherwise it does nothing for the job:
        when another daemon holds the lease it steps down for good; when nobody can be seen
        holding it (etcd unreachable) it waits, its workers left as they are."""
        assert self.leadership is not None
        if self.leadership.hold():
            term = self.leadership.lease.term
            if term is None or term.token == self._checked_term:
                return True
            # a term won here without a takeover (the job's start, or this daemon restarted):
            # if another daemon led the job since, this daemon's own state of it is stale
            self._checked_term = term.token
            record = self.leadership.record()
            if record is None or record.leader == self.leadership.holder:
                return True
            self._step_down(record.leader)
            return False
        holder = self.leadership.holder_now()
        if holder and holder != self.leadership.holder:
            self._step_down(holder)
        return False

    def _step_down(self, holder: str) -> None:
        """Another daemon leads the job: this one ends its own agent and workers (the new
        leader relaunched the job without them; they would only hold up its group) and from
        now on forwards the job's calls to `holder`."""
        self._kill_agent(now=True)
        if self.leadership is not None:
            self.leadership.release()
        if self.store.get_job(self.name).leader != holder:
            self.store.record(self.name, EventKind.STATE, f"{holder or 'another daemon'} leads "
                              f"the job now (this daemon's lease ran out); it follows",
                              cause="leader_lost", leader=holder, agent_pid=0,
                              agent_started=0)
        self.log.warning("following", leader=holder)

    # ---- decide + act: one handler per (state, requested state), see daemon/decisions.py ----

    def _decide_and_act(self, job: Job, obs: Observation, agent_exit: int | None,
                        faults: list[Fault]) -> None:
        tick = Tick(job, obs, agent_exit, faults,
                    agent_running=self.agent is not None and agent_exit is None)
        self._handlers[handler_for(job.state, job.desired_state, job.rollback_step >= 0)](tick)

    def _wind_down(self, t: Tick) -> None:
        """A pause or stop is requested: the workers get the command; once they (and the other
        nodes' agents) are done, the job ends in the requested state. Hung workers cannot obey:
        the request is then carried out without them."""
        job, want = t.job, t.job.desired_state
        hung = next((f for f in t.faults if f.cause in ("hang", "startup_timeout")), None)
        if t.agent_running and hung is not None:
            # workers that cannot obey the request: it is carried out without them (no
            # restart); nothing is lost that a restart would have kept
            self._record_fault(job, hung)
            self._kill_agent(now=True)
            kept = f"the newest committed checkpoint (step {job.last_ckpt_step}) is kept" \
                if job.last_ckpt_step >= 0 else "no checkpoint was committed yet"
            self._to(want, f"{want.name.lower()} on request without the workers' final "
                     f"checkpoint ({hung.message}); {kept}", cause=hung.cause, agent_pid=0,
                     agent_started=0)
            return
        if t.agent_running:
            self._deliver_command(job)
            return
        if job.state is JobState.PAUSED and want is JobState.PAUSED:
            return
        if Command.decode(job.command_action) != Command(Action.STOP_NOW) and \
                self.nodes.busy(job):
            return  # their ranks may still be committing the checkpoint
        if Command.decode(job.command_action) == Command(Action.STOP_NOW) and \
                want is JobState.STOPPED:
            self._stop_now_without_backlog(job, t)
            return
        if not self._durable_first(job, want):
            return
        if done_reason(job.done_reason) is DoneReason.COMPLETED and t.agent_exit == 0:
            # the last step came before the workers read the pause/stop command
            self._to(JobState.COMPLETED, f"workers completed all steps ({job.step}) before "
                     f"the {want.name.lower()} request took effect", agent_pid=0,
                     agent_started=0)
            return
        reason = job.done_reason or ("no workers were running" if self.agent is None
                                     else f"agent exit code {t.agent_exit}")
        self._to(want, f"{want.name.lower()} on request ({reason})", agent_pid=0,
                 agent_started=0)

    def _start(self, t: Tick) -> None:
        """PENDING (new) or PAUSED (resume) and to run: STARTING; the launch follows."""
        s = t.job.state
        self._to(JobState.STARTING, "starting workers" if s is JobState.PENDING
                 else "resuming from the newest checkpoint", agent_pid=0, agent_started=0,
                 done_reason="")
        self.agent = None

    def _bring_up(self, t: Tick) -> None:
        """STARTING or RECOVERING: launches the agent once its (back-off) time has come, then
        supervises it like a running one."""
        if self.agent is None:
            if time.time() >= t.job.next_launch_at:
                self._launch(t.job)
            return
        self._supervise(t)

    def _supervise(self, t: Tick) -> None:
        """The agent runs (deliver pending commands; STARTING/RECOVERING -> RUNNING at the
        workers' first `start` or `step` record) or has ended: after the workers' `done`
        with exit code 0, their reason decides; otherwise the first fault that restarts or
        fails the job does."""
        job, s = t.job, t.job.state
        if t.agent_running:
            self._deliver_command(job)
            if s in (JobState.STARTING, JobState.RECOVERING) and \
                    t.obs.kinds(RecordKind.START, RecordKind.STEP):
                self._to(JobState.RUNNING, "workers are training" if s is JobState.STARTING
                         else "recovered: workers are training again")
        elif t.agent_exit == 0 and job.done_reason:
            self._workers_done(job)
            return
        self._act_on_faults(job, t.faults)

    def _workers_done(self, job: Job) -> None:
        """The workers said `done` and their agent exited 0: a planned restart (not counted
        against the restart budget) or the end their reason names (FAILED for a reason the
        trainer does not write), once the other nodes' agents are done too."""
        if self.nodes.busy(job):
            return
        reason = done_reason(job.done_reason)
        if reason is DoneReason.REPARTITION:
            # the workers checkpointed and wrote partition.json (measured split or ds3dctl
            # rebalance): a planned restart, not counted against the restart budget
            self._to(JobState.RECOVERING, f"restarting the workers on a new pipeline "
                     f"partition from the checkpoint of step {job.step} (planned, not a "
                     f"fault)", cause="repartition", agent_pid=0, agent_started=0,
                     done_reason="", next_launch_at=0)
            return
        if reason is DoneReason.RESTART:  # _welcome_back: a lost node answers again
            self._to(JobState.RECOVERING, f"relaunching on all nodes from the checkpoint of "
                     f"step {job.step}: a lost node is back (planned, not a fault)",
                     cause="node_back", agent_pid=0, agent_started=0, done_reason="",
                     next_launch_at=0)
            return
        end = END_STATES.get(reason, JobState.FAILED) if reason is not None else JobState.FAILED
        if end is not JobState.FAILED and not self._durable_first(job, end):
            return
        self._to(end, f"workers exited after `done` ({job.done_reason}) at step {job.step}",
                 agent_pid=0, agent_started=0)

    def _durable_first(self, job: Job, end: JobState) -> bool:
        """True when the job may end in `end` (COMPLETED, PAUSED, STOPPED) as far as its
        checkpoints go: this node holds no checkpoint left local-complete but not durable by
        its exited workers. Otherwise ds3dd uploads and commits them (daemon/backlog_upload.py,
        retried with backoff through a store outage) and the job stays in its state, its status
        naming what is pending and why. Intent lives in the local markers, so a restarted
        daemon finds the same backlog. The tick that sees it all durable still returns False:
        the next one ingests the backlog's last records before the job ends."""
        if self.backlog is None:
            cfg = self._config(job)
            # remote_commit: also a final checkpoint whose parts are uploaded here and whose
            # commit the node of rank 0 still owes (awaiting_commit)
            self.backlog = BacklogUpload.start_if_needed(
                cfg, job.job_id, self.jobdir.path, self._local_dir(job), job.restarts,
                remote_commit=True, max_retry_s=self.ctx.backlog_retry_max_s)
            if self.backlog is None:
                return True
            self.store.record(self.name, EventKind.CHECKPOINT,
                              f"the workers exited with checkpoint step(s) "
                              f"{self.backlog.steps} not durable; " + (
                                  "ds3dd uploads them" if self.backlog.pending() else
                                  "waits for the node of rank 0 to commit them") +
                              f" before the job becomes {end.name}", cause="backlog",
                              step=self.backlog.steps[-1],
                              detail={"steps": self.backlog.steps, "end": end.name})
        waiting = self.backlog.describe() if self.backlog.pending() else None
        if waiting is None and (others := self.backlog.not_durable()):
            waiting = (f"final checkpoint step {others[-1]}: this node's parts are in the "
                       f"store; waits for the node of rank 0 to commit steps {others}")
            if gone := self.nodes.unreachable():  # its ds3dd resumes the backlog when back
                waiting += f" (node(s) {', '.join(gone)} do not answer)"
        if waiting is not None:
            if job.message != waiting:
                self.store.update(self.name, message=waiting)
            return False
        backlog, self.backlog = self.backlog, None
        backlog.finish()
        took = time.time() - backlog.started
        self.store.record(self.name, EventKind.CHECKPOINT,
                          f"backlog durable after {took:.0f} s: checkpoint step(s) " + (
                              f"{sorted(backlog.committed)} committed by ds3dd"
                              if backlog.committed or backlog.abandoned else
                              f"{backlog.steps} committed by the node of rank 0") +
                          " after the workers exited" + (f"; abandoned {sorted(backlog.abandoned)}"
                                       if backlog.abandoned else ""),
                          cause="backlog_durable",
                          step=max(backlog.committed, default=backlog.steps[-1]),
                          detail={"committed": sorted(backlog.committed),
                                  "abandoned": sorted(backlog.abandoned),
                                  "seconds": round(took, 1)})
        self.wake.set()
        return False

    def _stop_now_without_backlog(self, job: Job, t: Tick) -> None:
        """`stop --now` ends the job without waiting for the store: checkpoints not durable
        yet stay on this node's local tier only, and the STOPPED message names them."""
        if self.backlog is not None:
            self.backlog.close()
            self.backlog = None
        local = sorted({p.step for p in local_backlog(self._local_dir(job))})
        reason = job.done_reason or ("no workers were running" if self.agent is None
                                     else f"agent exit code {t.agent_exit}")
        self._to(JobState.STOPPED, f"stop on request ({reason})" + (
            f"; checkpoint step(s) {local} were not durable and stay only in this node's "
            f"local tier {self._local_dir(job)} (stop --now does not wait for the store)"
            if local else ""), agent_pid=0, agent_started=0)

    def _local_dir(self, job: Job) -> Path:
        """This node's local checkpoint tier of the job (the workers' default: JOB_DIR/ckpt)."""
        local = self._config(job).checkpoint.local_dir
        return Path(local) if local else self.jobdir.ckpt

    def _act_on_faults(self, job: Job, faults: list[Fault]) -> None:
        """Records the faults in order, up to the first that restarts (or, past the restart
        budget, fails) the job or is fatal, and acts on that one."""
        for fault in faults:
            if fault.roll_back_before is not None:
                self._roll_back_past(job, fault)
                return
            fault = self._record_fault(job, fault)
            if fault.restart:
                self._restart_or_fail(job, fault)
                return
            if fault.fatal:
                self._kill_agent(now=True)
                self._to(JobState.FAILED, fault.message, cause=fault.cause, agent_pid=0)
                return

    def _roll_back_past(self, job: Job, fault: Fault) -> None:
        """A checkpoint that cannot be loaded (daemon/load_failures.py): a rollback to the newest
        committed checkpoint before it (durable and verified, downloaded if need be), outside
        the restart budget (a new start, not the same one again); or, when there is none, this
        one was the target of such a rollback already, or its conversion to a new layout
        failed (an older one needs the same), PAUSED with every checkpoint kept."""
        bad = int(fault.roll_back_before or 0)
        older = [r.step for r in self.store.checkpoints(self.name)
                 if r.phase == "committed" and r.step < bad]
        after = fault.detail.get("rolled_back_from")
        reshape = fault.detail.get("reshape")
        if older and after is None and reshape is None:
            to = max(older)
            fault = replace(fault, message=(
                f"{fault.message}; rolling back to the checkpoint of step {to}: steps "
                f"{to + 1}-{bad} are trained again, and the rollback deletes checkpoint step "
                f"{bad} with any newer one"), detail={**fault.detail, "rollback_to": to})
            self._record_fault(job, fault)
            self.incidents.fault(fault.cause, fault.detected_at)
            self._kill_agent(now=True)  # now: by the next tick's rollback, a third group loads it
            self.store.request_rollback(
                self.name, to, f"rollback to step {to} past unloadable checkpoint step {bad}")
            return
        why = (f"checkpoint step {after} could not be loaded either, and two unloadable "
               "checkpoints point to the environment (DeepSpeed's version, the configuration, "
               "the disk) more than to the checkpoints" if after is not None else
               "no committed checkpoint before it to roll back to")
        ways_out = ("Fix the cause and `ds3dctl resume JOB`, or `ds3dctl rollback JOB --step N` "
                    "to an older checkpoint (`ds3dctl checkpoints JOB`)")
        if reshape is not None:
            why = "every older checkpoint needs the same conversion"
            ways_out = ("Bring back the layout it was saved with (its nodes) and `ds3dctl "
                        "resume JOB`, or fix the conversion's cause (DeepSpeed's version, the "
                        "job's [parallel] settings) and resume")
        fault = replace(fault, message=f"{fault.message}; PAUSED with every checkpoint kept: "
                                       f"{why}. {ways_out}")
        self._record_fault(job, fault)
        self._kill_agent(now=True)
        self._to(JobState.PAUSED, fault.message, cause=fault.cause,
                 desired_state=JobState.PAUSED, agent_pid=0, agent_started=0)

    def _record_fault(self, job: Job, fault: Fault) -> Fault:
        """The fault's event (a hang's with the ranks' stacks), metric and log line; returns
        the fault as recorded."""
        if fault.cause == "hang":
            fault = self._with_stacks(job, fault)
        extra: dict[str, Any] = {"rank": fault.rank}
        if fault.step is not None:
            extra["step"] = fault.step
        if fault.detail:
            extra["detail"] = fault.detail
        self.store.record(self.name, fault.kind, fault.message, cause=fault.cause, **extra)
        self.ctx.metrics.faults.labels(self.name, fault.cause).inc()
        self.log.warning(fault.kind, cause=fault.cause, detail=fault.message, step=job.step)
        return fault

    def _with_stacks(self, job: Job, fault: Fault) -> Fault:
        """A hang fault with the Python stacks of this node's ranks (taken before the kill),
        the suspects (first the ranks that could not answer, then those not waiting in a
        collective) and the step in progress. Its detection time stays the detector's."""
        try:
            dump = dump_stacks(self.jobdir.path, job.attempt, host=self.ctx.node)
        except Exception:  # noqa: BLE001 - diagnostics must not stop the recovery
            self.log.exception("stack capture failed")
            dump = StackDump()
        stuck = suspects(dump)
        rank = stuck[0] if stuck and (len(stuck) == 1 or stuck[0] in dump.unanswered) else -1
        step = job.step + 1  # the step the ranks were working on
        quiet = [r for r in stuck if r not in dump.unanswered]
        who = "; ".join(
            [f"rank {r} (pid {u['pid']} on {u['host']}) did not answer: {u['why']}"
             for r, u in sorted(dump.unanswered.items())] +
            ([f"rank {quiet[0]} is not in a collective" if len(quiet) == 1 else
              f"ranks {quiet} are not in a collective"] if quiet else []))
        who = who or "every rank waits in a collective"
        message = (f"{fault.message}; at step {step}: {who}; stacks of ranks "
                   f"{sorted(dump.stacks)} ({dump.method or 'none captured'}) in the event "
                   f"detail (ds3dctl events JOB --detail)")
        detail = {**fault.detail, "stacks": {str(r): t for r, t in sorted(dump.stacks.items())},
                  "stack_method": dump.method, "suspects": stuck,
                  "unanswered": {str(r): u for r, u in sorted(dump.unanswered.items())}}
        return Fault(fault.cause, message, fault.restart, rank=rank, step=step, detail=detail,
                     fatal=fault.fatal, detected_at=fault.detected_at)

    def _restart_or_fail(self, job: Job, fault: Fault) -> None:
        policy = self.ctx.restart_policy(self._config(job))
        decision = policy.decide(restarts_in_a_row(job), fault.cause)
        self._kill_agent(now=True)
        if decision.restart:  # timed from the detector's decision, not the end of the kill
            self.incidents.fault(fault.cause, fault.detected_at)
        else:
            self.incidents.drop()
            self._to(JobState.FAILED, f"{decision.reason}; last fault: {fault.message}",
                     cause=fault.cause, agent_pid=0)
            return
        self.ctx.metrics.restarts.labels(self.name, fault.cause).inc()
        self._to(JobState.RECOVERING, decision.reason, cause=fault.cause, agent_pid=0,
                 agent_started=0, **counted_restarts(job), done_reason="",
                 next_launch_at=time.time() + decision.delay_s)

    def _rollback(self, t: Tick) -> None:
        """Stop the workers without saving, tell them which step to load, start them again."""
        job = t.job
        if t.agent_running:
            self._kill_agent(now=True)
        self.jobdir.write_restore(job.rollback_step, job.command_id)
        self.nodes.forward_control("restore.json",
                                   (self.jobdir.control / "restore.json").read_text())
        dst = JobState.STARTING if job.state is JobState.PAUSED else JobState.RECOVERING
        self._to(dst, f"rolling back to the checkpoint of step {job.rollback_step}",
                 cause="rollback", rollback_step=-1, agent_pid=0, agent_started=0,
                 done_reason="", next_launch_at=0)

    def _launch(self, job: Job) -> None:
        """Starts (or finds) the agent of the next attempt; intent (the attempt number) first."""
        cfg = self._config(job)
        if self.backlog is not None:  # the new workers resume these uploads themselves
            self.backlog.close()
            self.backlog = None
        self.jobdir.create(job.config_json)
        attempt = job.attempt
        found = Launcher.find(self.jobdir.path, attempt) if attempt else None
        started_new = found is None or found.poll() is not None
        if not started_new:
            self.agent = found  # started before a daemon crash, never recorded
        else:
            attempt += 1
            stray = kill_strays(self.jobdir.path)  # workers of an agent that was killed
            if stray:
                self.log.warning("ended stray workers before relaunch", pids=stray)
            release_semaphores(self.jobdir.path)
            # commands were meant for the previous workers; new workers must not replay them
            self.jobdir.command_file.unlink(missing_ok=True)
            self.store.update(self.name, attempt=attempt, command_acked=job.command_id)
            endpoint = self._ensure_rdzv(job)
            run_id = rendezvous_run_id(self.name, attempt, job.job_id, bool(cfg.launch.rendezvous))
            # the other nodes first: this node's agent waits for as many agents as started
            # (arrivals.py), so that none misses the rendezvous's first round
            try:
                others = self.nodes.start_shares(cfg, endpoint, run_id, attempt)
            except PeerError as e:
                fault = Fault("node_lost", str(e), restart=True)
                self.store.record(self.name, EventKind.FAULT, fault.message, cause=fault.cause)
                self.ctx.metrics.faults.labels(self.name, fault.cause).inc()
                self.log.warning("fault", cause=fault.cause, detail=fault.message)
                self._restart_or_fail(self.store.get_job(self.name), fault)
                return
            self.agent = self.ctx.launcher.start(
                self.jobdir.path, cfg, attempt, endpoint, run_id, expected_nodes=1 + others,
                restarts_left=cfg.launch.max_restarts - restarts_in_a_row(job))
        assert self.agent is not None
        self.store.record(self.name, EventKind.LAUNCH,
                          f"agent attempt {attempt} pid {self.agent.ref.pid}",
                          agent_pid=self.agent.ref.pid, agent_started=self.agent.ref.started)
        self.log.info("agent started", attempt=attempt, pid=self.agent.ref.pid)

    def _ensure_rdzv(self, job: Job) -> str:
        endpoints = self._config(job).launch.etcd_endpoints
        if endpoints:  # torch elastic's etcd rendezvous: the head hosts no store of its own
            return etcd_endpoint(endpoints)
        ref = ProcessRef(job.rdzv_pid, job.rdzv_started)
        if not ref.alive():
            ref, port = start_store(self.jobdir.path, self.ctx.rdzv_host)
            self.store.update(self.name, rdzv_pid=ref.pid, rdzv_started=ref.started,
                              rdzv_port=port)
        else:
            port = job.rdzv_port
        return f"{self.ctx.rdzv_host}:{port}"

    def _deliver_command(self, job: Job) -> None:
        """(Re)writes the pending command unless the workers already have it; escalates a
        `stop_now` that the workers did not obey within the grace period."""
        if not job.command_id or job.command_acked >= job.command_id:
            return
        command = Command.decode(job.command_action)
        current = self.jobdir.command()
        if current is None or int(current.get("id", 0)) < job.command_id:
            if command is None:
                raise ValueError(f"command {job.command_id} is pending but none is stored")
            self.jobdir.write_command(job.command_id, command)
            self.nodes.forward_control("command.json", self.jobdir.command_file.read_text())
            self.log.info("command written", id=job.command_id, action=str(command.action))
            return
        if command == Command(Action.STOP_NOW) and \
                time.time() - float(current.get("time", 0)) > self.ctx.stop_now_grace_s:
            self.log.info("stop --now: terminating the agent")
            self._kill_agent(now=True)

    def _kill_agent(self, now: bool) -> None:
        """Ends the agent (its group) and any of its workers left behind (own sessions), then
        unlinks the named semaphores of a group that left them (semaphores.py)."""
        if self.agent is not None and self.agent.poll() is None:
            self.agent.ref.terminate(grace_s=2.0 if now else 30.0)
            if self.agent.popen is not None:
                self.agent.popen.poll()
        stray = kill_strays(self.jobdir.path)
        if stray:
            self.log.warning("ended stray workers", pids=stray)
        release_semaphores(self.jobdir.path)

    # ---- a lost node returns ----------------------------------------------------------------

    def _welcome_back(self, job: Job) -> None:
        """An elastic job running on fewer processes than configured: a lost node whose daemon
        answers again is taken back at a planned restart point. The workers get a `restart`
        command: they checkpoint at the next step, wait for its commit and exit; the agents end
        with them, and the head relaunches the job (done reason `restart`: not counted as a
        fault), which starts every node's share again. The new group forms on all nodes and
        restores that checkpoint reshaped to the larger DP: no step is lost. The change is
        recorded by _note_world_change (`node_joined`, DP old -> new) when its rank 0 starts.

        Why not let the returning agent join the running rendezvous as a waiting node (torch
        elastic restarts on num_nodes_waiting > 0)? After the survivors had re-rendezvoused
        without the lost node their keep-alive heartbeats were seen to stop (torch 2.x c10d
        handler): the joining node dropped them as dead and waited alone in a round of its
        own. A fresh attempt (new run id) has no such state, and ending the workers by command
        leaves no checkpoint half uploaded."""
        if job.state is not JobState.RUNNING or job.desired_state is not JobState.RUNNING or \
                job.rollback_step >= 0 or self.nodes.returning is None or not self._world:
            return
        cfg = self._config(job)
        if not cfg.elastic or self._world >= cfg.parallel.world_size:
            return
        pending = job.command_acked < job.command_id
        if pending and Command.decode(job.command_action) == Command(Action.RESTART):
            return  # ours, under way
        back = self.nodes.returning.poll(self.name, self.nodes.addresses(job))
        if not back:
            return
        if pending:  # another command first, unless the workers never acknowledged it
            cmd = self.jobdir.command()
            if cmd is None or time.time() - float(cmd.get("time", 0)) < REJOIN_COMMAND_WAIT_S:
                return
        for address in back:
            self.nodes.returning.offered(address)
            self.nodes.reachable_again(address)
        cid, action = job.command_id + 1, Command(Action.RESTART).encode()
        self.store.record(self.name, EventKind.COMMAND,
                          f"node(s) {', '.join(back)} back: checkpoint, "
                          f"then relaunch on all nodes", command_id=cid, command_action=action,
                          detail={"id": cid, "action": action, "time": time.time()})
        self.wake.set()  # deliver the command on the next tick

    # ---- bookkeeping -------------------------------------------------------------------------

    def _to(self, dst: JobState, message: str, cause: str = "", **fields: Any) -> None:
        job = self.store.transition(self.name, dst, message, cause=cause, **fields)
        self.log.info("state", to=dst.name, message=message, step=job.step)
        if fields.get("agent_pid") == 0:
            self.agent = None

    def _count_group_restarts(self, job: Job, obs: Observation) -> str | None:
        """The agent's own group restarts (a rank-0 `start` with restart > 0) count against the
        job's restart budget like the daemon's relaunches. Returns their cause (None if there
        were none)."""
        starts = [r for r in obs.kinds(RecordKind.START) if r.get("rank") == 0]
        cause = self._note_world_change(job, starts)
        new = {(job.attempt, int(r.get("restart", 0))) for r in starts
               if int(r.get("restart", 0)) > 0}
        new -= self._seen_group_restarts
        if not new:
            # a shrunk group whose rank 0 now sits on a node whose agent re-rendezvoused for
            # the membership change, not for a failure of its own, starts with restart 0
            return cause if cause == "node_lost" else None
        self._seen_group_restarts |= new
        self.store.update(self.name, **counted_restarts(job, len(new)))
        self.ctx.metrics.restarts.labels(self.name, cause).inc(len(new))
        return cause

    def _note_store_wait(self, job: Job, obs: Observation) -> None:
        """Workers that have trained their last step wait for their newest checkpoint to be
        durable (trainer/loop.py wait_for_store) and say so: the status says what is pending
        (their heartbeats also keep the hang detector quiet)."""
        waits = [r for r in obs.kinds(RecordKind.HEARTBEAT) if r.get("phase") == "store_wait"]
        if not waits or job.state is not JobState.RUNNING:
            return
        w = waits[-1]
        failed = w.get("failed") or []
        message = (f"workers {w.get('why', 'done')} at step {w.get('step')}; waiting for the "
                   f"store: checkpoint step {w.get('newest')} not durable yet after "
                   f"{w.get('waited_s', 0):.0f} s (rank {w.get('rank')}: pending "
                   f"{w.get('pending')}" + (f", failed and retried {failed}; see the "
                                            "checkpoint events for the error" if failed else "")
                   + ")")
        if job.message != message:
            self.store.update(self.name, message=message)

    def _recovered(self, incident: Incident) -> None:
        """One `recovered` event per fault the job came back from, with its time to detect,
        time to recover and steps lost, and the same numbers in the metrics."""
        detail = incident.as_detail()
        self.store.record(self.name, EventKind.RECOVERED, incident.message(),
                          cause=incident.cause,
                          step=incident.resumed_from or 0, detail=detail)
        m = self.ctx.metrics
        if incident.time_to_detect_s is not None:
            m.detect_seconds.labels(self.name, incident.cause).observe(incident.time_to_detect_s)
        if incident.time_to_recover_s is not None:
            m.recover_seconds.labels(self.name, incident.cause).observe(incident.time_to_recover_s)
        m.steps_lost.labels(self.name, incident.cause).inc(incident.steps_lost)
        self.log.info("recovered", **detail)

    def _note_world_change(self, job: Job, starts: list[dict[str, Any]]) -> str:
        """An elastic job's group came back with fewer (node lost) or more (node back)
        processes: one event saying what changed, and the cause its restart is counted under."""
        cause = "worker_exit"
        for rec in starts:
            world = int(rec.get("world_size", 0))
            old, self._world = self._world, world
            if not old or world == old:
                continue
            cfg = self._config(job)
            dp_old, dp_new = old // (cfg.parallel.tp * cfg.parallel.pp), int(rec.get("dp", 0))
            gone = self.nodes.unreachable()
            if world < old:
                cause = "node_lost"
                message = (f"node lost{': ' + ', '.join(gone) + ' unreachable' if gone else ''}; "
                           f"the job goes on with {world} of {old} processes: DP {dp_old} -> "
                           f"{dp_new}, TP x PP and the global batch kept, the checkpoint "
                           f"reshaped (universal) to the new layout")
                self.store.record(self.name, EventKind.FAULT, message, cause=cause,
                                  step=int(rec.get("step", 0)))
                self.ctx.metrics.faults.labels(self.name, cause).inc()
            else:
                cause = "node_joined"
                message = (f"node(s) back: the job grows from {old} to {world} processes, DP "
                           f"{dp_old} -> {dp_new}, from the reshaped checkpoint")
                self.store.record(self.name, EventKind.RECOVERY, message, cause=cause,
                                  step=int(rec.get("step", 0)))
            self.log.warning("world size changed", old=old, new=world, cause=cause)
        return cause

    def _cleanup(self, job: Job) -> None:
        """Terminal: nothing of the job may keep running on any node."""
        self._kill_agent(now=True)
        ProcessRef(job.rdzv_pid, job.rdzv_started).terminate(grace_s=2.0)
        self.nodes.stop_shares(self._config(job))
        remove_job_folder(job.job_id)  # its workers' newest save in /dev/shm: RAM

    def _config(self, job: Job) -> JobConfig:
        """The job's configuration, parsed once and held (keyed by the job and the stored
        text), not again at each use on every tick. Read-only: callers must not change it."""
        held = self._held_config
        if held is None or held[0] != job.name or held[1] != job.config_json:
            held = (job.name, job.config_json, JobConfig.model_validate_json(job.config_json))
            self._held_config = held  # one assignment: the service's thread may read it too
        return held[2]
