"""Turning the workers' report records into stored events and job figures.

`ReportTail.poll` reads every rank file from its stored offset (trainer/report.py
`read_records`), converts the records to events with a fixed schema, and commits events,
checkpoint index rows, job figures (step, loss, tokens/s) and the new offsets in ONE store
transaction — so a daemon crash at any point neither loses a record nor counts it twice.

A rank's records come in segments (trainer/report.py); each is tailed from its own offset, and a
segment read to its end with KEPT_SEGMENTS newer ones of its rank beside it is deleted after the
transaction that stored its last records, then its offset row (a crash in between leaves a row
without a file: harmless). A restarted daemon resumes every remaining segment from its stored
offset; a segment it has no row for is read from its start.

Heartbeats are not stored (one per rank per step would dwarf everything else); their times are
kept in memory for the hang detector (a restarted daemon's detector reads the newest report
files' times and pids from disk once: detectors.ReportsOnDisk). Of the
memory-only snapshots (`held_in_memory`, possibly one every few steps for weeks) only the first
of each worker group is an event, which says they are being taken and what one blocks; each one
sets the job's `memory_snapshot_step` (`ds3dctl status`). A restarted daemon stores the next one
it reads as an event again: it does not know whether the group's first was stored.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds3d.trainer.kinds import SKIPPED_UPDATE, EventKind, RecordKind
from ds3d.trainer.report import KEPT_SEGMENTS, parse_segment_name, read_records

from .jobdir import JobDir
from .logging import get_logger
from .store import Store

log = get_logger("ds3d.reports")


@dataclass
class Observation:
    """What one poll saw: the new records and the latest liveness per rank."""

    records: list[dict[str, Any]] = field(default_factory=list)
    last_seen: dict[int, float] = field(default_factory=dict)  # rank -> monotonic seconds

    def kinds(self, *kinds: RecordKind) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") in kinds]


# Fields the daemon's readers of records (here, detectors, incidents, oom, step analysis) take
# as numbers: a record where one is of another type is passed over whole (ReportTail._usable)
_INT_FIELDS = ("rank", "step", "restart", "world_size", "dp", "stage", "id", "pid",
               "recovered_to")
_NUMBER_FIELDS = ("time", "seconds", "process_started", "step_time_s", "blocked_s")


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


def record_to_event(rec: dict[str, Any]) -> dict[str, Any] | None:
    """A report record as an event row (None for records not stored as events). Its kind is
    the record's (an EventKind of the same name), but for a restarted group's rank-0 `start`;
    a kind this daemon does not know (a newer trainer's) is stored as it is."""
    kind = rec.get("kind", "")
    if kind == RecordKind.HEARTBEAT:
        return None
    step = rec.get("step")
    ev: dict[str, Any] = {
        "time": _num(rec.get("time")) or time.time(), "kind": kind,
        "step": int(step) if isinstance(step, int | float) else -1,
        "rank": int(rec.get("rank", -1)), "node": str(rec.get("node", "")),
        "restart": int(rec.get("restart", 0)), "detail": rec,
    }
    if kind == RecordKind.STEP:
        ev["loss"] = _num(rec.get("loss"))
        ev["tokens_per_s"] = _num(rec.get("tokens_per_s"))
        ev["message"] = f"step {ev['step']} loss {ev['loss']}"
    elif kind == RecordKind.FAULT:
        ev["cause"] = str(rec.get("cause", ""))
        ev["message"] = f"{ev['cause']} at step {ev['step']}: {rec.get('detail', '')}"
    elif kind == RecordKind.CHECKPOINT:
        ev["message"] = f"checkpoint step {ev['step']} {rec.get('phase', '')}"
        if rec.get("phase") in MEMORY_SNAPSHOT_PHASES:
            ev["message"] = MEMORY_SNAPSHOT_PHASES[rec["phase"]].format(
                step=ev["step"], blocked_s=rec.get("blocked_s", "?"),
                detail=rec.get("detail", ""))
        if rec.get("phase") == "restoring" and rec.get("source"):  # engine_io.RestorePlan
            ev["message"] += f" from {RESTORE_SOURCES.get(rec['source'], rec['source'])}"
        if rec.get("phase") in PROBLEM_PHASES:  # the whole truth, not only a phase name
            ev["cause"] = str(rec.get("cause") or rec.get("phase"))
            template = PROBLEM_PHASES.get(f"{rec['phase']}:{rec.get('cause')}",
                                          PROBLEM_PHASES[rec["phase"]])
            ev["message"] = template.format(
                step=ev["step"], cause=ev["cause"], detail=rec.get("detail", ""),
                reshape=rec.get("reshape", "?"))
    elif kind == RecordKind.START:
        ev["message"] = (f"rank {ev['rank']} started (restart {ev['restart']}, world "
                         f"{rec.get('world_size')}, from step {rec.get('step', 0)})")
        if ev["restart"] > 0 and ev["rank"] == 0:
            ev["kind"] = EventKind.RECOVERY
            ev["cause"] = "worker_exit"
            ev["message"] = f"worker group restarted by the agent ({ev['message']})"
    elif kind == RecordKind.RECOVERY:  # an in-process recovery (trainer/loop.py)
        ev["cause"] = str(rec.get("cause", ""))
        a, b = (rec.get("skipped_batches") or [0, 0])[:2]  # [a, b): batches skipped from now
        skipped = "" if b <= a else f", batch {a} skipped" if b == a + 1 else \
            f", batches {a}-{b - 1} skipped"
        if rec.get("source") == SKIPPED_UPDATE:
            how = (f"every rank skipped its update; undone in place, back to step "
                   f"{rec.get('recovered_to')}")
        else:
            source = f" (read from {rec['source']})" if rec.get("source") else ""
            how = f"rolled back to the checkpoint of step {rec.get('recovered_to')}{source}"
        ev["message"] = (f"{ev['cause']} at step {ev['step']}: {how} in {rec.get('seconds', 0)} "
                         f"s{skipped}")
    elif kind == RecordKind.DONE:
        ev["message"] = f"workers done at step {ev['step']}: {rec.get('reason', '')}"
    elif kind == RecordKind.CHECKPOINT_INTERVAL:
        ev["message"] = describe_interval(rec)
    elif kind == RecordKind.COMMAND:
        ev["message"] = (f"command {rec.get('id')} {rec.get('action')} "
                         f"{rec.get('status', '')}")
    elif kind == RecordKind.PROFILE:  # trainer/layer_profile.py: one stage's measured layers
        layers = rec["layers"] if isinstance(rec.get("layers"), list) else []
        ev["message"] = (f"layer profile of stage {rec.get('stage')} (rank {ev['rank']}): "
                         f"{len(layers)} layer(s) over {rec.get('steps_sampled')} step(s) at "
                         f"step {ev['step']}, partition {rec.get('partition')} (ds3dctl "
                         "rebalance JOB --dry-run)")
    elif kind == RecordKind.REPARTITION:
        ev["message"] = (f"pipeline stages {rec.get('current')} -> {rec.get('proposed')} "
                         f"({rec.get('source')}): {rec.get('decision')}")
    else:
        ev["message"] = json.dumps(rec)[:200]
    return ev


def describe_interval(rec: dict[str, Any]) -> str:
    """A `checkpoint_interval` record (trainer/checkpoint_interval.py) in one line: the
    durable interval ("auto"), the memory-only one (`memory_` keys, memory_interval "auto"),
    or both."""
    def f(key: str) -> float:
        return _num(rec.get(key)) or 0.0

    parts = []
    if "interval_s" in rec:
        guess = "" if rec.get("measured") else ", initial guess until a save commits"
        parts.append(
            f"checkpoint every {f('interval_s'):.0f} s = max(sqrt(2 x C {f('save_cost_s'):.1f} s"
            f" x MTBF {f('mtbf_s') / 3600:.2f} h), commit {f('commit_s'):.1f} s); C = blocked "
            f"{f('blocked_s'):.2f} s + commit {f('commit_s'):.1f} s{guess}; MTBF from "
            f"{int(f('failures'))} failure(s) in {f('observed_s') / 3600:.2f} h running and a "
            f"prior of {f('mtbf_prior_s') / 3600:.1f} h")
    if "memory_interval_s" in rec:
        parts.append(describe_memory_interval(rec, f))
    return "; ".join(parts) if parts else json.dumps(rec)[:200]


def _duration(seconds: float) -> str:
    """Seconds as a person reads them: a snapshot interval can be 0.2 s or 2 h."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


# where a memory-only snapshot's cost C_mem came from (MemoryIntervalDecision.cost_source)
MEMORY_COST_SOURCES = {
    "memory": "the running mean of {n} memory-only snapshot(s) blocking training",
    "durable": "the newest durable save's blocked time, until a memory-only snapshot is measured",
    "unmeasured": "not measured yet: a memory-only snapshot is taken at once to measure it",
}


def describe_memory_interval(rec: dict[str, Any], f: Callable[[str], float]) -> str:
    """The memory-only snapshot interval (`memory_` keys, trainer/checkpoint_interval.py
    `MemoryIntervalDecision`) and what it was decided from, in one line."""
    source = MEMORY_COST_SOURCES.get(str(rec.get("memory_cost_source")), "?").format(
        n=int(f("memory_snapshots")))
    durable = f("memory_durable_s")
    bound = (f"capped at the durable interval {_duration(durable)} (none taken: the next "
             "durable save comes first)" if rec.get("memory_capped") else
             f"at least one step {_duration(f('memory_step_s'))}, at most the durable interval "
             + (_duration(durable) if durable else "(not known yet)"))
    return (f"memory-only snapshot every {_duration(f('memory_interval_s'))} = sqrt(2 x C_mem "
            f"{f('memory_snapshot_cost_s'):.3f} s x MTBF {_duration(f('memory_mtbf_s'))}) = "
            f"{_duration(f('memory_young_daly_s'))}, {bound}; C_mem = {source}; MTBF from "
            f"{int(f('memory_failures'))} failure(s) in {_duration(f('memory_observed_s'))} "
            f"running and a prior of {_duration(f('memory_mtbf_prior_s'))}")


# Where a restart's restore reads its checkpoint (`restoring` records: engine_io.RestorePlan)
RESTORE_SOURCES = {"node_memory": "node memory (the crashed workers' newest snapshot, no disk "
                                  "read)",
                   "local": "the node-local tier", "store": "the durable store"}

# Memory-only snapshots (checkpoint.memory_interval, trainer/loop.py): events only, never in
# the checkpoint index (no files: nothing to list, restore by hand or upload)
MEMORY_SNAPSHOT_PHASES = {
    "held_in_memory": "step {step} held in memory only (a memory-only snapshot for rollbacks "
                      "and crash restarts, no files; training blocked {blocked_s} s)",
    "memory_snapshots_off": "{detail}",  # names the setting, that it is off and why
}

# Checkpoint phases that enter the checkpoint index ("uploaded", "reshaped", "swept" are
# progress reports, "cleanup_failed" a fault of the cleanup, not of a checkpoint: events only;
# "retention" marks the steps it deleted).
INDEXED_PHASES = ("saved", "committed", "failed", "abandoned", "skipped")
# Checkpoint records that report a problem: their event message (and a metric, supervisor.py)
PROBLEM_PHASES = {
    "skipped": "checkpoint step {step} skipped by the restore ({cause}): {detail}",
    "abandoned": "checkpoint step {step} abandoned, never to be committed: {detail}",
    "failed": "checkpoint step {step}: upload or commit failed, retried later: {detail}",
    # a save the local disk had no room for (checkpoints/snapshot.py): dropped, not retried
    "failed:disk_full": "checkpoint step {step} failed and was dropped (training goes on, the "
                        "next save tries again): {detail}",
    "cleanup_failed": "cleanup failed at checkpoint step {step} ({cause}; no checkpoint's "
                      "state changed): {detail}",
    # DeepSpeed could not load a checkpoint whose hashes verified (trainer/load_failure.py)
    "load_failed": "checkpoint step {step} could not be loaded (its files verified): {detail}",
    # ... nor converted to the job's new layout by DeepSpeed's universal checkpoint (a lost node)
    "load_failed:reshape": "checkpoint step {step} could not be converted to this layout "
                           "({reshape}) by DeepSpeed's ds_to_universal: {detail}",
    # a new pipeline split it could not be converted to: the split it was saved with is kept
    "reshape_failed": "checkpoint step {step} could not be converted to the new pipeline split "
                      "({detail}); the job trains on in the split it was saved with",
}


class ReportTail:
    """Tails one job's report files into the store. A checkpoint record without a path is
    indexed under `ckpt_dir/global_step<N>` (DeepSpeed's default tag, used by the trainer)."""

    def __init__(self, store: Store, jobdir: JobDir, ckpt_dir: Path | None = None) -> None:
        self.store = store
        self.jobdir = jobdir
        self.ckpt_dir = ckpt_dir or jobdir.ckpt
        self.last_seen: dict[int, float] = {}
        self._group_has_held = False  # a held_in_memory event of the current group is stored

    def poll(self) -> Observation:
        name = self.jobdir.name
        offsets = self.store.offsets(name)
        new_offsets: dict[str, int] = {}
        obs = Observation()
        files = self.jobdir.report_files()
        for path in files:
            key = self.jobdir.report_key(path)
            records, end = read_records(path, offsets.get(key, 0))
            if end != offsets.get(key, 0):
                new_offsets[key] = end
            obs.records.extend(r for r in records if self._usable(r, key))
        if not new_offsets:
            obs.last_seen = dict(self.last_seen)
            return obs
        obs.records.sort(key=lambda r: _num(r.get("time")) or 0.0)
        now = time.monotonic()
        events, ckpts, figures = [], [], self._figures(obs.records)
        if "last_ckpt_step" in figures:  # an older step committed late (a retried upload)
            figures["last_ckpt_step"] = max(figures["last_ckpt_step"],
                                            self.store.get_job(name).last_ckpt_step)
        for rec in obs.records:
            self.last_seen[int(rec.get("rank", -1))] = now
            ev = record_to_event(rec)
            if ev is not None and not self._routine_snapshot(rec):
                events.append(ev)
            ckpts += self._checkpoint_rows(rec, ev)
        self.store.ingest(name, new_offsets, events, ckpts, **figures)
        self._drop_read_segments(files, {**offsets, **new_offsets})
        obs.last_seen = dict(self.last_seen)
        return obs

    def _routine_snapshot(self, rec: dict[str, Any]) -> bool:
        """A `held_in_memory` record after the first of its worker group (a rank-0 `start`
        begins a group): a figure of the job, not an event (module docstring)."""
        if rec.get("kind") == RecordKind.START and rec.get("rank", 0) == 0:
            self._group_has_held = False
        if rec.get("kind") != RecordKind.CHECKPOINT or rec.get("phase") != "held_in_memory":
            return False
        routine, self._group_has_held = self._group_has_held, True
        return routine

    def _checkpoint_rows(self, rec: dict[str, Any], ev: dict[str, Any] | None,
                         ) -> list[dict[str, Any]]:
        """The checkpoint index rows a record makes (none for most kinds)."""
        if rec.get("kind") == RecordKind.CHECKPOINT and isinstance(rec.get("step"), int) and \
                rec.get("phase", "saved") in INDEXED_PHASES:
            step = rec["step"]
            phase = str(rec.get("phase", "saved"))
            ck_path = rec.get("path") or (self.ckpt_dir / f"global_step{step}"
                                          if phase in ("saved", "committed", "failed") else "")
            return [{"step": step, "phase": phase, "path": str(ck_path),
                     "time": ev["time"] if ev else 0,
                     "blocked_s": _num(rec.get("blocked_s")) or 0.0,
                     "detail": ev["message"] if ev is not None and
                     phase in PROBLEM_PHASES else ""}]
        # steps deleted by the workers: retention, a rollback's abandoned timeline, a fault
        # recovery's checkpoints of suspect steps (listed as committed, then "missing", before)
        deleted: Any = []
        why = ""
        if rec.get("kind") == RecordKind.CHECKPOINT and rec.get("phase") == "retention":
            deleted, why = rec.get("deleted") or [], f"by retention after step {rec.get('step')}"
        elif rec.get("kind") == RecordKind.CHECKPOINT and rec.get("phase") == "rolled_back":
            deleted, why = rec.get("deleted") or [], f"by the rollback to step {rec.get('step')}"
        elif rec.get("kind") == RecordKind.RECOVERY and rec.get("dropped_checkpoints"):
            deleted = rec["dropped_checkpoints"]
            why = f"by the recovery to step {rec.get('recovered_to')} (trained on suspect steps)"
        if not isinstance(deleted, list):  # a damaged record: passed over (_usable)
            raise TypeError("deleted steps are not a list")
        return [{"step": s, "phase": "deleted", "time": ev["time"] if ev else 0,
                 "detail": f"deleted {why}"}
                for s in deleted if isinstance(s, int) and not isinstance(s, bool)]

    def _usable(self, rec: dict[str, Any], key: str) -> bool:
        """A record that converts (event, figures, index rows). One that does not (a field of
        the wrong type: a file edited or damaged by hand, or another program's) is logged and
        passed over: raised, it would fail every tick of the job's supervisor forever, as the
        offsets of its file are never committed."""
        try:
            for name in _INT_FIELDS:
                if not isinstance(rec.get(name, 0), int) or isinstance(rec.get(name), bool):
                    raise TypeError(f"{name} is not an integer")
            for name in _NUMBER_FIELDS:
                v = rec.get(name)
                if v is not None and (not isinstance(v, int | float) or isinstance(v, bool)
                                      or not math.isfinite(v)):
                    raise TypeError(f"{name} is not a finite number")
            self._checkpoint_rows(rec, record_to_event(rec))
            self._figures([rec])
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            log.warning("report record passed over: it does not convert", job=self.jobdir.name,
                        file=key, error=f"{type(e).__name__}: {e}", record=json.dumps(
                            rec, default=str)[:300])
            return False
        return True

    def _drop_read_segments(self, files: list[Path], offsets: dict[str, int]) -> None:
        """Deletes the segments stored to their end (`offsets`: committed) that have
        KEPT_SEGMENTS newer ones of their rank in their folder, then their offset rows."""
        by_rank: dict[tuple[Path, int], list[Path]] = {}
        for path in files:  # in segment order (JobDir.report_files)
            parsed = parse_segment_name(path.name)
            if parsed is not None:
                by_rank.setdefault((path.parent, parsed[0]), []).append(path)
        dropped = []
        for segments in by_rank.values():
            for path in segments[:-KEPT_SEGMENTS]:
                key = self.jobdir.report_key(path)
                if read_to_end(path, offsets.get(key, 0)):
                    path.unlink(missing_ok=True)
                    dropped.append(key)
        if dropped:
            self.store.forget_offsets(self.jobdir.name, dropped)

    def _figures(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Job columns implied by the newest records (step, loss, throughput, world size...)."""
        out: dict[str, Any] = {}
        for rec in records:
            kind = rec.get("kind")
            if kind == RecordKind.STEP and rec.get("rank", 0) == 0:
                out["step"] = int(rec.get("step", 0))
                loss = _num(rec.get("loss"))
                out["loss"] = loss if loss is not None and math.isfinite(loss) else None
                out["tokens_per_s"] = _num(rec.get("tokens_per_s")) or 0.0
                out["step_time_s"] = _num(rec.get("step_time_s")) or 0.0
            elif kind == RecordKind.START and rec.get("rank", 0) == 0:
                out["world_size"] = int(rec.get("world_size", 0))
                out.setdefault("step", int(rec.get("step", 0) or 0))
            elif kind == RecordKind.CHECKPOINT and rec.get("phase") in ("saved", "committed"):
                out["last_ckpt_step"] = max(out.get("last_ckpt_step", -1), int(rec["step"]))
            elif kind == RecordKind.CHECKPOINT and rec.get("phase") == "held_in_memory" and \
                    isinstance(rec.get("step"), int):
                # the newest, not the largest: after a rollback the steps start lower again
                out["memory_snapshot_step"] = rec["step"]
            elif kind == RecordKind.DONE:
                out["done_reason"] = str(rec.get("reason", ""))
            elif kind == RecordKind.COMMAND and rec.get("status") == "done":
                out["command_acked"] = max(out.get("command_acked", 0), int(rec.get("id", 0)))
        return out


def read_to_end(path: Path, offset: int) -> bool:
    """Whether nothing but a torn line (no newline: a writer killed mid-record, which no writer
    completes once the rank has newer segments) follows `offset` in a segment."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return b"\n" not in fh.read()
    except FileNotFoundError:
        return True
