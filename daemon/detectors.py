"""Fault detectors: small objects, one method over what the supervisor observed.

Each returns a `Fault` or None; the supervisor asks every detector each tick and hands the faults
to its restart policy. Faults the workers detect and recover from themselves (NaN, loss spike:
agreed through an all-reduce, handled in-process) arrive as `fault` records and are only counted
here; the daemon detects what the workers cannot report: a hang, a dead agent.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ds3d.trainer.process_age import process_age_s

from .reports import Observation
from .states import JobState
from .store import Job

EXIT_CONFIG = 2  # trainer/worker.py: configuration refused; the agent passes it on


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
    kind: str = "fault"  # the event kind: "fault", or "diagnosis" for advice that changes nothing


class Detector(Protocol):
    def check(self, job: Job, obs: Observation, agent_exit: int | None) -> Fault | None: ...


class HangDetector:
    """No report from any rank for longer than a timeout derived from the measured step time:
    `max(min_timeout_s, factor x median step time)`. The clock starts when this detector first
    sees the job RUNNING, so a daemon restart gives the workers a full timeout again.

    A worker group the elastic agent restarted on its own (a worker exited: the job stays
    RUNNING) needs start-up time before its first report (imports, rendezvous, restore): until
    that first report, silence is measured from the newest worker process's start and allowed
    `startup_s`, not the step-derived timeout."""

    def __init__(self, min_timeout_s: float = 120.0, factor: float = 20.0,
                 startup_s: float = 120.0) -> None:
        self.min_timeout_s = min_timeout_s
        self.factor = factor
        self.startup_s = max(startup_s, min_timeout_s)
        self._since: float | None = None
        self._step_times: list[float] = []

    def timeout_s(self) -> float:
        if not self._step_times:
            return self.min_timeout_s
        return max(self.min_timeout_s, self.factor * statistics.median(self._step_times[-50:]))

    def check(self, job: Job, obs: Observation, agent_exit: int | None) -> Fault | None:
        if job.state is not JobState.RUNNING or agent_exit is not None:
            self._since = None
            return None
        now = time.monotonic()
        if self._since is None:
            self._since = now
        for rec in obs.kinds("step"):
            t = rec.get("step_time_s")
            if isinstance(t, int | float) and t > 0:
                self._step_times.append(float(t))
        last = max([self._since, *obs.last_seen.values()])
        silent = now - last
        if silent <= self.timeout_s():
            return None
        started = newest_worker_start(job.agent_pid, now)
        # (process start times are known to ~1 s: the kernel's boot time is whole seconds; no
        # group reports within seconds of its start, so the slack cannot hide a real report)
        if started is not None and started + START_SLACK_S > last:  # restarted, not reporting
            if now - started <= self.startup_s:
                return None
            self._since = now
            return Fault("hang", f"the worker group the agent restarted sent no report in "
                         f"{now - started:.0f} s since it started (start-up allowance "
                         f"{self.startup_s:.0f} s)", restart=True)
        self._since = now
        return Fault("hang", f"no report from any rank for {silent:.0f} s (timeout "
                     f"{self.timeout_s():.0f} s)", restart=True)


START_SLACK_S = 1.5


def newest_worker_start(agent_pid: int, now_monotonic: float) -> float | None:
    """When the newest process under the local elastic agent started, on the monotonic clock
    (None without a local agent, e.g. on a node that only heads the job)."""
    import psutil

    if agent_pid <= 0:
        return None
    try:
        children = psutil.Process(agent_pid).children(recursive=True)
    except psutil.Error:
        return None
    ages = [age for age in (process_age_s(c.pid) for c in children) if age is not None]
    return now_monotonic - min(ages) if ages else None


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
