"""Time to detect, time to recover and steps lost of every fault a job recovers from.

A fault is noticed in one of three places, and the clock of its incident starts there:

    daemon      a detector fired and the supervisor restarts the workers (hang, agent exit,
                OOM, a node unreachable at launch): `detected` = when it fired
    agent       torch elastic restarted the group by itself (a crashed worker, a lost node):
                the daemon learns of it from the new group's rank-0 `start` record (restart
                count > 0, or a smaller world: rank 0 may now sit on a node whose agent only
                re-rendezvoused, restart 0); `detected` = when that group's first process
                started (the agent's own detection and the re-rendezvous come before it, so this
                bounds detection from above)
    workers     an in-process recovery (NaN, loss spike): the trainer's `recovery` record has
                its own duration and steps lost; detection is the failing step itself. Its
                `source` says where the state came from: a rollback's checkpoint ("memory",
                "local", "store"), or "skipped_update" (nothing read: every rank's optimizer
                skipped the bad update, the step was undone in place, one step lost)

For the first two, `progress stopped` is the newest rank-0 step record before the detection and
the incident closes at the first rank-0 step record after it:

    time to detect   detected - progress stopped
    time to recover  first step after - detected
    steps lost       newest step before - the step the new group resumed from

A second fault while one incident is open joins it (one recovery, first cause). Planned
restarts (pause/resume, repartition, a node back) open nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds3d.trainer.kinds import SKIPPED_UPDATE, RecordKind


@dataclass
class Incident:
    cause: str
    noticed_by: str            # "daemon" | "agent" | "workers"
    detected: float            # unix seconds
    last_step: int             # the newest step before the fault (-1: none yet)
    last_step_time: float | None
    resumed_from: int | None = None
    recovered: float | None = None
    source: str | None = None  # an in-process recovery's: where it read the state from

    @property
    def time_to_detect_s(self) -> float | None:
        if self.last_step_time is None:
            return None
        return max(0.0, self.detected - self.last_step_time)

    @property
    def time_to_recover_s(self) -> float | None:
        return None if self.recovered is None else max(0.0, self.recovered - self.detected)

    @property
    def steps_lost(self) -> int:
        if self.resumed_from is None or self.last_step < 0:
            return 0
        return max(0, self.last_step - self.resumed_from)

    def as_detail(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 3)
        return {"cause": self.cause, "noticed_by": self.noticed_by,
                "time_to_detect_s": r(self.time_to_detect_s),
                "time_to_recover_s": r(self.time_to_recover_s), "steps_lost": self.steps_lost,
                "last_step": self.last_step, "resumed_from": self.resumed_from,
                **({"source": self.source} if self.source else {})}

    def message(self) -> str:
        detect = self.time_to_detect_s
        noticed = ("" if detect is None else
                   f"noticed {detect:.1f} s after the last step ({self.noticed_by}), ")
        where = ("" if not self.source else " (in place: the update was skipped)"
                 if self.source == SKIPPED_UPDATE else f" (read from {self.source})")
        return (f"recovered from {self.cause}: {noticed}training again "
                f"{self.time_to_recover_s or 0.0:.1f} s later from step {self.resumed_from}"
                f"{where}; {self.steps_lost} step(s) trained again")


class IncidentClock:
    """Fed every rank-0 record in time order (`observe`) and every daemon-side fault that
    restarts the workers (`fault`); returns each incident once it is closed."""

    def __init__(self) -> None:
        self.open: Incident | None = None
        self.last_step, self.last_step_time = -1, None  # type: tuple[int, float | None]
        # the newest rank-0 `restoring` record's (step, source): written before the `start`
        # record of the group that restored it ("node_memory", "local", "store")
        self.restoring: tuple[int, str] | None = None

    @classmethod
    def resumed(cls, run_dir: str, step: int) -> IncidentClock:
        """The clock of a job this daemon starts supervising, maybe after a restart of its own:
        the newest step is rank 0's newest step record on disk (with its time), else the job's
        stored `step` (time unknown). A fresh clock knew no step, and a fault right after a
        daemon restart was counted as "0 step(s) trained again" whatever the workers had
        trained."""
        from .detectors import ReportsOnDisk

        clock = cls()
        newest = ReportsOnDisk.read(run_dir).last_step
        if newest is not None:
            clock.last_step, clock.last_step_time = newest
        elif step > 0:
            clock.last_step = step
        return clock

    def fault(self, cause: str, now: float) -> None:
        """The daemon restarts the workers because of `cause`."""
        if self.open is None:
            self.open = Incident(cause, "daemon", now, self.last_step, self.last_step_time)

    def drop(self) -> None:
        """The job ended (FAILED, stopped): nothing will recover."""
        self.open = None

    def observe(self, records: list[dict[str, Any]], agent_cause: str | None = None
                ) -> list[Incident]:
        """Rank-0 records (any order); `agent_cause` is the cause of an agent-side group
        restart seen in them (worker_exit, node_lost), None if there is none."""
        closed: list[Incident] = []
        for rec in sorted((r for r in records if r.get("rank") == 0),
                          key=lambda r: float(r.get("time", 0.0))):
            kind, t = rec.get("kind"), float(rec.get("time", 0.0))
            if kind == RecordKind.START:
                self._on_start(rec, t, agent_cause)
            elif kind == RecordKind.STEP:
                inc = self.open
                if inc is not None and inc.resumed_from is not None and t > inc.detected:
                    inc.recovered = t
                    closed.append(inc)
                    self.open = None
                self.last_step, self.last_step_time = int(rec.get("step", 0)), t
            elif kind == RecordKind.RECOVERY and "recovered_to" in rec:
                closed.append(Incident(
                    str(rec.get("cause", "")), "workers", t, int(rec.get("step", 0)), t,
                    resumed_from=int(rec["recovered_to"]),
                    recovered=t + float(rec.get("seconds", 0.0)),
                    source=str(rec["source"]) if rec.get("source") else None))
                self.last_step, self.last_step_time = int(rec["recovered_to"]), t
            elif kind == RecordKind.CHECKPOINT and rec.get("phase") == "restoring" \
                    and rec.get("source"):
                self.restoring = (int(rec.get("step", -1)), str(rec["source"]))
        return closed

    def _on_start(self, rec: dict[str, Any], t: float, agent_cause: str | None) -> None:
        step = int(rec.get("step", 0))
        restarted = int(rec.get("restart", 0)) > 0 or agent_cause == "node_lost"
        if self.open is None and restarted and agent_cause and agent_cause != "node_joined":
            spawned = float(rec.get("process_started") or 0.0) or t
            self.open = Incident(agent_cause, "agent", spawned, self.last_step,
                                 self.last_step_time)
        restoring, self.restoring = self.restoring, None
        if self.open is not None:
            self.open.resumed_from = step
            if restoring is not None and restoring[0] == step:
                self.open.source = restoring[1]  # a restart's: where its restore read from
