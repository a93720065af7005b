"""The failure history a job's `checkpoint.interval = "auto"` is computed from.

The trainer's Young-Daly interval (trainer/checkpoint_interval.py) needs the job's mean time
between failures. Only the daemon sees every failure: a crash or a hang ends the processes that
would have counted it. So the supervisor publishes, as `control/failures.json`, the number of
recoveries it has recorded for the job (one `recovered` event per fault the job came back from:
crash, hang, lost node, NaN and spike rollbacks) and the seconds the job has been running
(STARTING, RUNNING or RECOVERING: the time in which a failure could happen), on every node of
the job, since rank 0 may run on any of them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from ds3d.trainer.checkpoint_interval import FAILURES_FILE
from ds3d.trainer.kinds import EventKind

from .states import JobState
from .store import Store

EXPOSED = (JobState.STARTING, JobState.RUNNING, JobState.RECOVERING)


class FailureHistory:
    """Publishes a job's failure count and running time: at once when the count changes,
    otherwise every `every_s` seconds (the running time grows in between)."""

    def __init__(self, store: Store, name: str, every_s: float = 30.0) -> None:
        self.store, self.name, self.every_s = store, name, every_s
        self._failures: int | None = None
        self._at = -float("inf")

    def current(self) -> tuple[int, float]:
        return (self.store.count_events(self.name, EventKind.RECOVERED),
                self.store.seconds_in(self.name, EXPOSED))

    def publish(self, write: Callable[[str, str], None], now: float | None = None) -> bool:
        """Writes the file through `write(file, text)` when due; True when it wrote."""
        now = time.monotonic() if now is None else now
        failures = self.store.count_events(self.name, EventKind.RECOVERED)
        if failures == self._failures and now - self._at < self.every_s:
            return False
        observed = self.store.seconds_in(self.name, EXPOSED)
        write(FAILURES_FILE, json.dumps({"failures": failures, "observed_s": round(observed, 3)}))
        self._failures, self._at = failures, now
        return True
