"""`checkpoint.interval = "auto"`: checkpoint as often as it pays (Young–Daly).

A checkpoint costs C seconds; a failure throws away the work since the last one. With failures
arriving at mean time MTBF, the interval that loses the least time is Young's first-order
optimum, tau = sqrt(2 * C * MTBF) (Young 1974; Daly 2006 shows it is within a few percent of the
higher-order optimum while C << MTBF).

The inputs, as ds3d measures them:

* **C** = the time a save blocks training (the snapshot) + the time from the save to the durable
  commit of its manifest, both measured on rank 0 on the newest save (the issue that asked for
  this defines the cost that way; it makes the interval conservative while the store is slow).
* **MTBF** = the failure rate the daemon observes for this job (every recovery it records: crash,
  hang, lost node, NaN and spike rollbacks) over the time the job has been running, smoothed
  by a prior: the configured `auto_mtbf_prior_hours` counts as one failure observed in that much
  time. So MTBF = (prior_h + observed_h) / (1 + failures): the prior alone at first, the data
  once there is much of it.
* tau is never shorter than the time to commit: a save started before the previous one is
  durable only queues behind it (uploads are serialised) and buys no safety.

`checkpoint.memory_interval = "auto"` (`MemoryInterval`) applies the same optimum to the
memory-only snapshots taken between durable saves: tau_mem = sqrt(2 * C_mem * MTBF), with the
same MTBF (one `FailureReading`) and C_mem = the time a memory-only snapshot blocks training,
a running mean (EWMA) of rank 0's measured ones. Before the first, the newest durable save's
blocked time stands in (the same copy into the same kind of arena); before any save, C_mem is
unknown and the first snapshot is taken at the first step, to measure it. tau_mem is never
shorter than one step (the loop decides once a step) and is capped at the durable interval:
a memory-only snapshot no sooner than the next durable save is pointless.

Both clocks live on rank 0 only; their verdicts ("a save is due", "a memory-only snapshot is
due") go to every rank through the loop's per-step all-reduce, so all ranks save or hold at
the same step.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# control/failures.json, written by the daemon: {"failures": n, "observed_s": seconds running}
FAILURES_FILE = "failures.json"


def young_daly(save_cost_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval in seconds: sqrt(2 * C * MTBF)."""
    if save_cost_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need C >= 0 and MTBF > 0, got C={save_cost_s}, MTBF={mtbf_s}")
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def mtbf_estimate(prior_s: float, failures: int, observed_s: float) -> float:
    """Posterior mean time between failures: the prior counts as one failure in `prior_s`."""
    if prior_s <= 0:
        raise ValueError(f"the MTBF prior must be > 0 s, got {prior_s}")
    return (prior_s + max(0.0, observed_s)) / (1 + max(0, failures))


@dataclass(frozen=True)
class IntervalDecision:
    """One computation of the interval and everything it was made from (reported as is)."""

    interval_s: float  # seconds between saves
    young_daly_s: float  # sqrt(2 C MTBF) before the commit-time floor
    save_cost_s: float  # C = blocked_s + commit_s
    blocked_s: float  # the newest save's snapshot time (training blocked)
    commit_s: float  # the newest save's time from save to durable commit
    mtbf_s: float  # the posterior MTBF used
    mtbf_prior_s: float
    failures: int  # failures the daemon has observed for the job
    observed_s: float  # running time they were observed over
    measured: bool  # False while C is still the initial guess (no save committed yet)

    def record(self) -> dict[str, float | int | bool]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}


class FailureReading:
    """The job's failure history as the daemon publishes it (control/failures.json) and the
    MTBF it gives with the configured prior: the one reading both "auto" clocks (the durable
    interval, `AutoInterval`, and the memory-only one, `MemoryInterval`) compute from, so
    they agree on the MTBF. Re-read at most every `reread_s` seconds."""

    def __init__(self, control_dir: Path, prior_hours: float, reread_s: float = 10.0) -> None:
        self.path = control_dir / FAILURES_FILE
        self.prior_s = prior_hours * 3600.0
        self.failures, self.observed_s = 0, 0.0
        self.reread_s, self._read_at = reread_s, -math.inf

    def read(self, now: float | None = None) -> bool:
        """Re-reads the daemon's failure history; True when it changed."""
        now = time.monotonic() if now is None else now
        if now - self._read_at < self.reread_s:
            return False
        self._read_at = now
        try:
            data = json.loads(self.path.read_text())
            failures, observed = int(data["failures"]), float(data["observed_s"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
            return False  # no daemon (plain torchrun) or a file mid-replace: keep what we have
        if failures < 0 or not math.isfinite(observed) or observed < 0:
            return False
        changed = failures != self.failures
        self.failures, self.observed_s = failures, observed
        return changed

    def mtbf_s(self) -> float:
        return mtbf_estimate(self.prior_s, self.failures, self.observed_s)


def moved(new: float, old: float) -> bool:
    """An interval worth a new report: more than 10% away from the one in force."""
    return abs(new - old) > 0.1 * max(old, 1e-9)


class AutoInterval:
    """Rank 0's clock for `checkpoint.interval = "auto"`.

    `due(now)` says whether the newest save is older than the current interval. The save
    cost is measured on each save (`saved`, then `committed` from the upload thread); the
    failure history is the shared `FailureReading` (the caller re-reads it).
    """

    def __init__(self, history: FailureReading, initial_cost_s: float) -> None:
        self.history = history
        self.blocked_s, self.commit_s, self.measured = 0.0, initial_cost_s, False
        self.last_save = time.monotonic()  # the start counts as a save: restore point or step 0
        self._pending: dict[int, float] = {}  # step -> monotonic time of its save
        self._lock = threading.Lock()
        self.decision = self._decide()

    # -- measurements -------------------------------------------------------------------------

    def saved(self, step: int, blocked_s: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.last_save = now
            self.blocked_s = blocked_s
            self._pending[step] = now - blocked_s

    def committed(self, step: int, now: float | None = None) -> None:
        """Called from the upload thread when the manifest of `step` is in the store."""
        now = time.monotonic() if now is None else now
        with self._lock:
            started = self._pending.pop(step, None)
            if started is not None:
                self.commit_s, self.measured = max(0.0, now - started), True

    # -- the decision -------------------------------------------------------------------------

    def _decide(self) -> IntervalDecision:
        cost, h = self.blocked_s + self.commit_s, self.history
        mtbf = h.mtbf_s()
        yd = young_daly(cost, mtbf)
        return IntervalDecision(
            interval_s=max(yd, self.commit_s), young_daly_s=yd, save_cost_s=cost,
            blocked_s=self.blocked_s, commit_s=self.commit_s, mtbf_s=mtbf,
            mtbf_prior_s=h.prior_s, failures=h.failures, observed_s=h.observed_s,
            measured=self.measured)

    def update(self) -> IntervalDecision | None:
        """Recomputes the interval; returns the new decision when it moved by more than 10%
        or its inputs changed kind (first measurement, a new failure), else None."""
        with self._lock:
            new = self._decide()
        old = self.decision
        if (moved(new.interval_s, old.interval_s) or new.measured != old.measured
                or new.failures != old.failures):
            self.decision = new
            return new
        return None

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - self.last_save >= self.decision.interval_s


# weight of the newest measurement in the running means of a snapshot's cost and the step time
EWMA_WEIGHT = 0.25


def ewma(mean: float | None, sample: float, weight: float = EWMA_WEIGHT) -> float:
    """Running mean that follows a drift (pinned memory warming up, a busier node) within a
    few samples; the first sample is taken as is."""
    return sample if mean is None else (1.0 - weight) * mean + weight * sample


@dataclass(frozen=True)
class MemoryIntervalDecision:
    """One computation of the memory-only snapshot interval and its inputs. Reported inside
    the `checkpoint_interval` record with every key prefixed `memory_` (beside the durable
    interval's keys when that one is "auto" too)."""

    interval_s: float  # seconds between snapshots: Young-Daly, at least one step, at most durable
    young_daly_s: float  # sqrt(2 C_mem MTBF) before the floor and the cap
    snapshot_cost_s: float  # C_mem: training blocked per snapshot (0 while unknown)
    cost_source: str  # "memory" (memory-only snapshots measured), "durable" (the newest durable
    #                   save's blocked time), "unmeasured" (none yet: one is due to measure it)
    snapshots: int  # memory-only snapshots measured so far (by rank 0, this process)
    step_s: float  # running mean of a step's time: the floor (0 before the first step)
    durable_s: float  # the durable interval in seconds: the cap (0 while unknown)
    capped: bool  # Young-Daly reached the durable interval: no memory-only snapshot pays
    mtbf_s: float  # the posterior MTBF used (the durable clock's FailureReading)
    mtbf_prior_s: float
    failures: int
    observed_s: float

    def record(self) -> dict[str, float | int | bool | str]:
        return {f"memory_{k}": (round(v, 4) if isinstance(v, float) else v)
                for k, v in asdict(self).items()}


class MemoryInterval:
    """Rank 0's clock for `checkpoint.memory_interval = "auto"`.

    `due(now)` says whether the newest snapshot (memory-only or durable) is older than tau_mem.
    `held` measures a memory-only snapshot, `saved` takes note of a durable one (a stand-in
    cost until a memory-only one is measured, and a restore point all the same), `stepped`
    the step time; `update(durable_s)` recomputes against the durable interval in seconds.
    """

    def __init__(self, history: FailureReading) -> None:
        self.history = history
        self.memory_cost_s: float | None = None  # running mean of memory-only snapshots
        self.durable_blocked_s: float | None = None  # the newest durable save's blocked time
        self.snapshots = 0
        self.step_s: float | None = None
        self.durable_s = 0.0
        self.last_snapshot = time.monotonic()  # the start counts: restore point or step 0
        self.decision = self._decide()

    # -- measurements -------------------------------------------------------------------------

    def held(self, blocked_s: float, now: float | None = None) -> None:
        self.last_snapshot = time.monotonic() if now is None else now
        self.memory_cost_s = ewma(self.memory_cost_s, max(0.0, blocked_s))
        self.snapshots += 1

    def saved(self, blocked_s: float, now: float | None = None) -> None:
        self.last_snapshot = time.monotonic() if now is None else now
        self.durable_blocked_s = max(0.0, blocked_s)

    def stepped(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds > 0:
            self.step_s = ewma(self.step_s, seconds)

    # -- the decision -------------------------------------------------------------------------

    def _cost(self) -> tuple[float, str]:
        if self.memory_cost_s is not None:
            return self.memory_cost_s, "memory"
        if self.durable_blocked_s is not None:
            return self.durable_blocked_s, "durable"
        return 0.0, "unmeasured"

    def _decide(self) -> MemoryIntervalDecision:
        cost, source = self._cost()
        h, step = self.history, self.step_s or 0.0
        mtbf = h.mtbf_s()
        yd = young_daly(cost, mtbf)
        interval = max(yd, step)
        capped = self.durable_s > 0 and interval >= self.durable_s
        if capped:
            interval = self.durable_s
        return MemoryIntervalDecision(
            interval_s=interval, young_daly_s=yd, snapshot_cost_s=cost, cost_source=source,
            snapshots=self.snapshots, step_s=step, durable_s=self.durable_s, capped=capped,
            mtbf_s=mtbf, mtbf_prior_s=h.prior_s, failures=h.failures, observed_s=h.observed_s)

    def update(self, durable_s: float, force: bool = False) -> MemoryIntervalDecision | None:
        """Recomputes tau_mem under a durable interval of `durable_s` seconds (0: not known
        yet); returns the new decision when it or the durable interval moved by more than 10%,
        its inputs changed kind (where the cost comes from, a new failure, capped or not) or
        `force` (the durable "auto" interval was just decided anew: one record, both fresh),
        else None."""
        self.durable_s = max(0.0, durable_s)
        new, old = self._decide(), self.decision
        if (force or moved(new.interval_s, old.interval_s) or moved(new.durable_s, old.durable_s)
                or new.cost_source != old.cost_source or new.failures != old.failures
                or new.capped != old.capped):
            self.decision = new
            return new
        return None

    def due(self, now: float | None = None) -> bool:
        """A memory-only snapshot is due: the newest snapshot is older than tau_mem, and tau_mem
        is short of the durable interval (capped, the next durable save comes first)."""
        now = time.monotonic() if now is None else now
        d = self.decision
        return not d.capped and now - self.last_snapshot >= d.interval_s
