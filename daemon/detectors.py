"""Fault detectors: small objects, one method over what the supervisor observed.

Each returns a `Fault` or None; the supervisor asks every detector each tick and hands the faults
to its restart policy. Faults the workers detect and recover from themselves (NaN, loss spike:
agreed through an all-reduce, handled in-process) arrive as `fault` records and are only counted
here; the daemon detects what the workers cannot report: a hang, a dead agent.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ds3d.trainer.exit_codes import EXIT_CONFIG
from ds3d.trainer.kinds import EventKind, RecordKind
from ds3d.trainer.process_age import process_age_s
from ds3d.trainer.report import parse_segment_name, read_records, report_segments

from .extension_cache import find_locks
from .procs import job_workers
from .reports import Observation
from .states import JobState
from .store import Job


def agent_error(job: Job) -> str:
    """The error line the agent recorded in its result file for the job's current attempt."""
    import json
    from pathlib import Path

    try:
        path = Path(job.run_dir) / "control" / f"agent-{job.attempt}.exit"
        return str(json.loads(path.read_text()).get("error", "")) or "(no error recorded)"
    except (OSError, ValueError, AttributeError):
        return "(no error recorded)"


@dataclass(frozen=True)
class Fault:
    cause: str      # "hang", "agent_exit", ...
    message: str    # what was seen, for the event log
    restart: bool   # True: the worker group must be restarted from a checkpoint
    rank: int = -1  # the rank at fault, where one is known
    step: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    fatal: bool = False  # True: the job fails now, without a restart
    # a checkpoint that cannot be loaded (daemon/load_failures.py): restart from the newest
    # committed checkpoint before this step instead of the newest one
    roll_back_before: int | None = None
    kind: EventKind = EventKind.FAULT  # or DIAGNOSIS (advice that changes nothing), OOM
    # when the detector decided (unix seconds): an incident's time to detect ends here, not after
    # the stacks were taken and the workers killed
    detected_at: float = field(default_factory=time.time)


class Detector(Protocol):
    def check(self, job: Job, obs: Observation, agent_exit: int | None) -> Fault | None: ...


class HangDetector:
    """No report from any rank for longer than a timeout derived from the measured step time:
    `max(min_timeout_s, factor x median step time)`. The clock starts when this detector first
    sees the job RUNNING (a launch: the group's first report turns it RUNNING).

    A daemon restarted while the job runs (crash, upgrade, drain) picks up where its
    predecessor left off, from the reports on disk (`ReportsOnDisk`, read once at the first
    check): the silence counts from the newest report file's modification, not from this
    daemon's start; the pids that reported make the running group one that reported (else every
    group looked unreported after a restart and got the start-up allowance, measured from its
    workers' start: a hang already in progress went unnoticed for up to `--start-timeout`); the
    step times in them set the timeout. Records the restarted daemon reads in its first poll
    were written before it started: their arrival is no sign of life (`_caught_up_at`).

    A worker group the elastic agent restarted on its own (a worker exited: the job stays
    RUNNING) needs start-up time before its first report (imports, rendezvous, restore): until
    that first report, silence is measured from the newest worker process's start and allowed
    `startup_s`, not the step-derived timeout. A group has reported once a report came from one
    of its live worker processes (by pid)."""

    def __init__(self, min_timeout_s: float = 120.0, factor: float = 20.0,
                 startup_s: float = 120.0) -> None:
        self.min_timeout_s = min_timeout_s
        self.factor = factor
        self.startup_s = max(startup_s, min_timeout_s)
        self._since: float | None = None
        self._step_times: list[float] = []
        self._pids: set[int] = set()  # worker pids that sent a report
        # set at the first check: the reports on disk are read then; liveness (obs.last_seen)
        # stamped by a poll up to then is the catch-up of what was written before (see above)
        self._caught_up_at: float | None = None
        self._disk_last: float | None = None  # the newest report on disk then (monotonic)

    def timeout_s(self) -> float:
        if not self._step_times:
            return self.min_timeout_s
        return max(self.min_timeout_s, self.factor * statistics.median(self._step_times[-50:]))

    def check(self, job: Job, obs: Observation, agent_exit: int | None) -> Fault | None:
        now = time.monotonic()
        first = self._caught_up_at is None
        if first:  # this daemon's first look at the job: what its predecessor saw is on disk
            self._caught_up_at = now
            disk = ReportsOnDisk.read(job.run_dir)
            self._pids |= disk.pids
            self._step_times += disk.step_times
            if disk.newest_write is not None:
                self._disk_last = now - max(0.0, time.time() - disk.newest_write)
        # in every state: a group can report its start, train and save before the job's
        # first RUNNING tick, and then fall silent
        self._pids.update(r["pid"] for r in obs.records if isinstance(r.get("pid"), int))
        if job.state is not JobState.RUNNING or agent_exit is not None:
            self._since = None
            return None
        if self._since is None:
            # a group found running at the daemon's start: silent since its newest report
            self._since = (self._disk_last if first and self._disk_last is not None
                           else now)
        for rec in obs.kinds(RecordKind.STEP):
            t = rec.get("step_time_s")
            if isinstance(t, int | float) and t > 0:
                self._step_times.append(float(t))
        assert self._caught_up_at is not None
        seen = [t for t in obs.last_seen.values() if t > self._caught_up_at]
        last = max([self._since, *seen])
        silent = now - last
        if silent <= self.timeout_s():
            return None
        started = unreported_group_start(job.run_dir, self._pids, now)
        if started is not None:  # restarted, not reporting yet
            if now - started <= self.startup_s:
                return None
            self._since = now
            return Fault("hang", f"the worker group the agent restarted sent no report in "
                         f"{now - started:.0f} s since it started (start-up allowance "
                         f"{self.startup_s:.0f} s)", restart=True)
        self._since = now
        return Fault("hang", f"no report from any rank for {silent:.0f} s (timeout "
                     f"{self.timeout_s():.0f} s)", restart=True)


# how much of the end of each rank's newest report segment a restarted daemon reads back: a
# few hundred steps of rank 0's step and heartbeat records, a moment of a saving rank's
TAIL_BYTES = 256 * 1024


@dataclass(frozen=True)
class ReportsOnDisk:
    """What the workers' report files say of the running group, for a daemon that just started
    (its predecessor read these records and kept what they said in memory only): the newest
    write to any report file (unix seconds, a file's modification time), the pids in the newest
    records of this node's ranks, their step times, and rank 0's newest step record."""

    newest_write: float | None = None
    pids: frozenset[int] = frozenset()
    step_times: tuple[float, ...] = ()
    last_step: tuple[int, float] | None = None  # rank 0's newest (step, time)

    @classmethod
    def read(cls, run_dir: str | Path, tail_bytes: int = TAIL_BYTES) -> ReportsOnDisk:
        reports = Path(run_dir) / "reports"
        newest: dict[tuple[Path, int], Path] = {}  # (folder, rank) -> its newest segment
        mtimes = []
        for folder in (reports, *sorted(reports.glob("nodes/*/"))):
            for path in report_segments(folder):  # rank, then segment order
                parsed = parse_segment_name(path.name)
                assert parsed is not None
                newest[(folder, parsed[0])] = path
                try:
                    mtimes.append(path.stat().st_mtime)
                except OSError:  # deleted by the tail meanwhile
                    continue
        pids: set[int] = set()
        step_times: list[float] = []
        last_step: tuple[int, float] | None = None
        for (folder, rank), path in sorted(newest.items()):
            if folder != reports and rank != 0:
                continue  # another node's worker: neither its pid nor a step record
            for rec in _tail_records(path, tail_bytes):
                if folder == reports and isinstance(rec.get("pid"), int):
                    pids.add(rec["pid"])
                if rec.get("kind") != RecordKind.STEP or rec.get("rank") != 0:
                    continue
                t = rec.get("step_time_s")
                if isinstance(t, int | float) and not isinstance(t, bool) and t > 0:
                    step_times.append(float(t))
                at = rec.get("time")
                if isinstance(rec.get("step"), int) and isinstance(at, int | float) and \
                        (last_step is None or at >= last_step[1]):
                    last_step = (rec["step"], float(at))
        return cls(max(mtimes, default=None), frozenset(pids), tuple(step_times[-50:]),
                   last_step)


def _tail_records(path: Path, tail_bytes: int) -> list[dict[str, Any]]:
    """The complete records in the last `tail_bytes` of a report segment, from the first line
    that begins there."""
    try:
        with open(path, "rb") as fh:
            start = max(0, fh.seek(0, 2) - tail_bytes)
            if start > 0:  # inside a record, or at the start of one right after a newline
                fh.seek(start - 1)
                start += fh.read(tail_bytes).find(b"\n")
    except OSError:
        return []
    return read_records(path, start)[0]


def unreported_group_start(run_dir: str, reported_pids: set[int],
                           now_monotonic: float) -> float | None:
    """When this node's worker group started, on the monotonic clock, if none of its processes
    has sent a report yet (a group the agent restarted); None once one has, or without local
    workers (a node that only heads the job). By pid, not by clock: forked workers report
    within a fraction of a second of their start. `reported_pids` is pruned to the live
    workers, so a reused pid is not taken for one that reported."""
    workers = job_workers(run_dir)
    reported_pids &= {p.pid for p in workers}
    if not workers or reported_pids:
        return None
    ages = [age for age in (process_age_s(p.pid) for p in workers) if age is not None]
    return now_monotonic - min(ages) if ages else None


class StartupDetector:
    """A worker group that has not reported its start within `timeout_s` of its launch.

    Starting covers imports, rendezvous, DeepSpeed's init (which may JIT-build an op under a file
    lock), building the engine and restoring the checkpoint; the `start` record of rank 0 ends
    it (the job then goes RUNNING and the hang detector takes over). Until then nothing else
    watches the group: a worker waiting forever on a build lock left by a killed process sent no
    report at all (issue 17). The fault restarts the group (the new agent clears stale locks of
    the job's own build folder) and names every build lock it finds, stale or held, with the
    ranks that reported nothing and the phase the others reached.

    The clock starts when the detector first sees the launch (an agent pid of a STARTING or
    RECOVERING job), so a daemon restart gives the group a full allowance again."""

    def __init__(self, timeout_s: float = 600.0,
                 lock_roots: Callable[[Job], list[Path]] | None = None) -> None:
        self.timeout_s = timeout_s
        self.lock_roots = lock_roots or (lambda job: [])
        self._launch: tuple[int, int] | None = None  # (attempt, agent pid) being timed
        self._since = 0.0
        self._phases: dict[int, str] = {}  # rank -> newest start-up phase reported

    def check(self, job: Job, obs: Observation, agent_exit: int | None) -> Fault | None:
        if job.state not in (JobState.STARTING, JobState.RECOVERING) or agent_exit is not None \
                or not job.agent_pid or job.desired_state is not JobState.RUNNING:
            self._launch = None
            return None
        now = time.monotonic()
        if self._launch != (job.attempt, job.agent_pid):
            self._launch, self._since, self._phases = (job.attempt, job.agent_pid), now, {}
        for rec in obs.records:
            if isinstance(rec.get("rank"), int):
                self._phases[rec["rank"]] = str(rec.get("phase") or rec.get("kind"))
        waited = now - self._since
        if obs.kinds(RecordKind.START, RecordKind.STEP) or waited <= self.timeout_s:
            return None
        self._launch = None  # once per launch; the restarted group is timed afresh
        locks = find_locks(self.lock_roots(job))
        silent = sorted(set(range(_world_size(job))) - set(self._phases))
        reached = ", ".join(f"rank {r}: {ph}" for r, ph in sorted(self._phases.items()))
        evidence = [f"reports so far: {reached}" if reached else "no rank sent any report"]
        if silent:
            evidence.append(f"ranks {silent} sent none")
        evidence += [lock.describe() for lock in locks]
        stale = [lock for lock in locks if lock.stale]
        fix = (f"ds3d removes stale locks of the job's own build folder before the restart; "
               f"remove {', '.join(str(lock.path) for lock in stale)} by hand if it is in a "
               f"shared cache" if stale else
               "look at the workers' stderr (ds3dctl logs JOB) for where they wait; raise "
               "ds3dd --start-timeout if starting legitimately takes longer (a large restore)")
        message = (f"the worker group sent no start record within {waited:.0f} s of its launch "
                   f"(--start-timeout {self.timeout_s:.0f} s): {'; '.join(evidence)}; {fix}")
        detail = {"waited_s": round(waited, 1), "timeout_s": self.timeout_s,
                  "phases": {str(r): ph for r, ph in sorted(self._phases.items())},
                  "silent_ranks": silent,
                  "locks": [{"path": str(lock.path), "age_s": round(lock.age_s, 1),
                             "stale": lock.stale, "holders": list(lock.holders),
                             "workers": list(lock.workers)} for lock in locks]}
        return Fault("startup_timeout", message, restart=True, detail=detail)


def _world_size(job: Job) -> int:
    """The processes the job's group should have (0 if its configuration cannot be read)."""
    from ds3d.trainer.config import JobConfig

    try:
        return JobConfig.model_validate_json(job.config_json).parallel.world_size
    except ValueError:
        return 0


class AgentExitDetector:
    """The agent ended while the job should be training and the workers did not say they are
    done: the agent's own restarts are spent, or it was killed."""

    def check(self, job: Job, obs: Observation, agent_exit: int | None) -> Fault | None:
        if agent_exit is None or job.desired_state is not JobState.RUNNING:
            return None
        if job.state not in (JobState.RUNNING, JobState.STARTING, JobState.RECOVERING):
            return None
        if agent_exit == 0 and job.done_reason:
            return None
        if agent_exit == EXIT_CONFIG:
            return Fault("config_refused", "the workers refused the job's configuration (exit "
                         f"code {EXIT_CONFIG}); restarting would not help: "
                         f"{agent_error(job)}", restart=False, fatal=True)
        how = "was killed" if agent_exit < 0 else f"exited with code {agent_exit}"
        why = f" ({agent_error(job)})" if agent_exit > 0 else ""
        return Fault("agent_exit", f"the elastic agent {how} before the workers finished{why}",
                     restart=True)
