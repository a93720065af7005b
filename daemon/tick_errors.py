"""A supervisor tick that keeps failing the same way, made visible on the job.

The supervisor retries a failed tick on the next one (a bug in one pass must not end the job's
supervision), but a failure that repeats leaves the job as it was while ds3dd's log fills with
the same traceback: on 12-06 a refused state transition kept a job RECOVERING for good, with
~500 tracebacks and a status that said nothing. Here the traceback is logged once per distinct
error, and an error that persists for REPORT_AFTER_S is recorded once on the job (a `fault`
event, cause `supervisor_error`, counted in ds3d_job_faults_total, and its status line), so
that `ds3dctl status` and `events` say what is wrong. A full disk is not handled here
(daemon/disk.py diagnoses it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ds3d.trainer.kinds import EventKind

from .store import Store

REPORT_AFTER_S = 30.0


class TickErrors:
    """The state of one job's failing ticks."""

    def __init__(self, store: Store, name: str, log: Any, count: Callable[[], None],
                 report_after_s: float = REPORT_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`count`: adds the reported fault to ds3d_job_faults_total."""
        self.store, self.name, self.log, self.count = store, name, log, count
        self.report_after_s = report_after_s
        self.clock = clock
        self._error = ""         # the error failing the ticks now ("" while they pass)
        self._since = 0.0
        self._reported = False

    def succeeded(self) -> None:
        if self._error:
            self.log.info("supervisor ticks pass again",
                          after_s=round(self.clock() - self._since, 1))
        self._error = ""

    def failed(self, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}"
        if error != self._error:
            self._error, self._since, self._reported = error, self.clock(), False
            self.log.exception("supervisor tick failed; retrying every tick")
            return
        failing_s = self.clock() - self._since
        if self._reported or failing_s < self.report_after_s:
            return
        self._reported = True
        message = (f"ds3dd cannot supervise this job: every pass fails with {error[:2000]} (for "
                   f"{failing_s:.0f} s; a ds3d defect, its traceback is in ds3dd's log); it "
                   "retries every pass")
        try:
            self.store.record(self.name, EventKind.FAULT, message, status=message,
                              cause="supervisor_error")
            self.count()
        except Exception:  # noqa: BLE001 - the store itself may be what fails
            self.log.exception("supervisor error not recorded on the job")
