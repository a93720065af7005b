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

`AutoInterval` lives on rank 0 only; its verdict ("a save is due") goes to every rank through
the loop's per-step all-reduce, so all ranks save at the same step.
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


class AutoInterval:
    """Rank 0's clock for `checkpoint.interval = "auto"`.

    `due(now)` says whether the newest save is older than the current interval. The save
    cost is measured on each save (`saved`, then `committed` from the upload thread); the
    failure history is re-read from the daemon's file at most every `reread_s` seconds.
    """

    def __init__(self, control_dir: Path, prior_hours: float, initial_cost_s: float,
                 reread_s: float = 10.0) -> None:
        self.path = control_dir / FAILURES_FILE
        self.prior_s = prior_hours * 3600.0
        self.blocked_s, self.commit_s, self.measured = 0.0, initial_cost_s, False
        self.failures, self.observed_s = 0, 0.0
        self.reread_s, self._read_at = reread_s, -math.inf
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

    def read_failures(self, now: float | None = None) -> bool:
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

    # -- the decision -------------------------------------------------------------------------

    def _decide(self) -> IntervalDecision:
        cost = self.blocked_s + self.commit_s
        mtbf = mtbf_estimate(self.prior_s, self.failures, self.observed_s)
        yd = young_daly(cost, mtbf)
        return IntervalDecision(
            interval_s=max(yd, self.commit_s), young_daly_s=yd, save_cost_s=cost,
            blocked_s=self.blocked_s, commit_s=self.commit_s, mtbf_s=mtbf,
            mtbf_prior_s=self.prior_s, failures=self.failures, observed_s=self.observed_s,
            measured=self.measured)

    def update(self) -> IntervalDecision | None:
        """Recomputes the interval; returns the new decision when it moved by more than 10%
        or its inputs changed kind (first measurement, a new failure), else None."""
        with self._lock:
            new = self._decide()
        old = self.decision
        moved = abs(new.interval_s - old.interval_s) > 0.1 * max(old.interval_s, 1e-9)
        if moved or new.measured != old.measured or new.failures != old.failures:
            self.decision = new
            return new
        return None

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - self.last_save >= self.decision.interval_s
