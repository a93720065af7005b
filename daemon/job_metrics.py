"""A supervised job's Prometheus series (daemon/metrics.py defines them): what each tick of its
supervisor exports from the stored job and the new report records, goodput included.

Kept apart from the supervisor's loop (daemon/supervisor.py) so that the loop only decides and
acts; the fault, restart and recovery counters stay where those happen.
"""

from __future__ import annotations

import statistics
import time

from ds3d.trainer.kinds import RecordKind

from .metrics import Metrics
from .reports import PROBLEM_PHASES, Observation
from .states import JobState
from .step_analysis import StepAnalysis
from .store import Job

_WORKING = (JobState.STARTING, JobState.RUNNING, JobState.RECOVERING)


class JobMetrics:
    """Exports one job's state, progress, step analysis, goodput and checkpoint series."""

    def __init__(self, metrics: Metrics, name: str, analysis: StepAnalysis) -> None:
        self.metrics = metrics
        self.name = name
        self.analysis = analysis
        self.goodput = Goodput()

    def export(self, job: Job, obs: Observation) -> None:
        m = self.metrics
        m.set_state(self.name, job.state)
        m.step.labels(self.name).set(job.step)
        if job.loss is not None:
            m.loss.labels(self.name).set(job.loss)
        m.tokens_per_s.labels(self.name).set(job.tokens_per_s)
        self.analysis.export(m, self.name)
        for rec in obs.kinds(RecordKind.STEP):
            if isinstance(rec.get("mfu"), int | float):
                m.mfu.labels(self.name).set(rec["mfu"])
        self.goodput.update(job, obs)
        ratio = self.goodput.ratio()
        if ratio is not None:
            m.goodput.labels(self.name).set(ratio)
        for rec in obs.kinds(RecordKind.CHECKPOINT):
            if rec.get("phase") == "committed" and isinstance(rec.get("time"), int | float):
                m.last_commit.labels(self.name).set(rec["time"])
            if isinstance(rec.get("blocked_s"), int | float):
                m.checkpoint_blocked.labels(self.name).observe(float(rec["blocked_s"]))
            if isinstance(rec.get("bytes"), int) and rec.get("phase") == "committed":
                m.upload_bytes.labels(self.name).inc(rec["bytes"])
            if rec.get("phase") in PROBLEM_PHASES:
                m.checkpoint_problems.labels(self.name, rec["phase"]).inc()


class Goodput:
    """Useful training time over wall time while the job should be training, since this
    daemon began supervising it: useful = new steps (re-trained ones are not new) x the median
    step time; restarts, recovery, re-training and blocked saves all lower it."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.useful = 0.0
        self._last_tick: float | None = None
        self._max_step: int | None = None
        self._step_times: list[float] = []

    def update(self, job: Job, obs: Observation) -> None:
        now = time.monotonic()
        if job.state in _WORKING and self._last_tick is not None:
            self.wall += now - self._last_tick
        self._last_tick = now if job.state in _WORKING else None
        for rec in obs.kinds(RecordKind.STEP):
            if rec.get("rank", 0) == 0 and isinstance(rec.get("step_time_s"), int | float):
                self._step_times = (self._step_times + [float(rec["step_time_s"])])[-100:]
                step = int(rec.get("step", 0))
                if self._max_step is None:
                    self._max_step = step - 1
                if step > self._max_step:
                    self.useful += (step - self._max_step) * statistics.median(self._step_times)
                    self._max_step = step

    def ratio(self) -> float | None:
        return min(1.0, self.useful / self.wall) if self.wall > 1.0 else None
