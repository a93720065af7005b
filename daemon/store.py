"""The daemon's durable memory: jobs, their transitions and events, report offsets, checkpoints.

SQLite in WAL mode, one file per daemon (`STATE_DIR/ds3d.db`). Why it is shaped like this:

* **Intent first.** A state transition and its event are written in one transaction *before*
  the daemon acts on it; a request (pause, save, rollback) is stored as the job's desired state
  and pending command before the command file is written. A daemon killed between deciding and
  acting finds the intent on restart and carries it out (see supervisor.py), instead of
  forgetting it.
* **Offsets with their events.** The read offset of each per-rank report file is stored in the
  same transaction as the events derived from the records before it, so after a crash every
  record is turned into an event exactly once.
* **One writer.** One connection guarded by a lock; readers (WatchEvents) wait on a condition
  that every commit of new events notifies, so a watch never polls the disk in a busy loop.
* **Bounded events.** A job's `step` and `checkpoint` events (about 1 and 1.4 a step) are kept
  to its newest `events_kept` of each kind (ds3dd --events-kept); every other kind (states,
  faults, recoveries, diagnoses, launches, done...) is the job's history and is never deleted.
  The older ones go in the transaction that stored the PRUNE_EVERY-th new one of a job since
  the last pruning, so pruning costs one indexed delete per thousand events, and a job holds
  at most events_kept + PRUNE_EVERY of each. Sequence numbers stay increasing (paging by
  `seq` sees a gap where rows went).

`synchronous=NORMAL` in WAL mode keeps every committed transaction across a process crash
(SIGKILL); only an OS crash or power cut may lose the last commits, which the report files and
checkpoints (the ground truth) let the daemon re-derive.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds3d.trainer.errors import AlreadyExistsError, NotFoundError, StateError
from ds3d.trainer.kinds import EventKind

from .states import TERMINAL, JobState, check_transition

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    config_json TEXT NOT NULL,
    state INTEGER NOT NULL,
    desired_state INTEGER NOT NULL,
    node TEXT NOT NULL,
    run_dir TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    message TEXT NOT NULL DEFAULT '',
    step INTEGER NOT NULL DEFAULT 0,
    loss REAL,
    tokens_per_s REAL NOT NULL DEFAULT 0,
    step_time_s REAL NOT NULL DEFAULT 0,
    world_size INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0,
    attempt INTEGER NOT NULL DEFAULT 0,
    last_ckpt_step INTEGER NOT NULL DEFAULT -1,
    agent_pid INTEGER NOT NULL DEFAULT 0,
    agent_started REAL NOT NULL DEFAULT 0,
    rdzv_pid INTEGER NOT NULL DEFAULT 0,
    rdzv_started REAL NOT NULL DEFAULT 0,
    rdzv_port INTEGER NOT NULL DEFAULT 0,
    command_id INTEGER NOT NULL DEFAULT 0,
    command_action TEXT NOT NULL DEFAULT '',
    command_acked INTEGER NOT NULL DEFAULT 0,
    rollback_step INTEGER NOT NULL DEFAULT -1,
    done_reason TEXT NOT NULL DEFAULT '',
    next_launch_at REAL NOT NULL DEFAULT 0,
    job_id TEXT NOT NULL DEFAULT '',
    leader TEXT NOT NULL DEFAULT '',
    listed_seq INTEGER NOT NULL DEFAULT 0,
    memory_snapshot_step INTEGER NOT NULL DEFAULT -1,
    restarts_in_a_row INTEGER NOT NULL DEFAULT 0,
    progress_mark INTEGER NOT NULL DEFAULT -1
);
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL REFERENCES jobs(name),
    from_state INTEGER NOT NULL,
    to_state INTEGER NOT NULL,
    time REAL NOT NULL,
    message TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL REFERENCES jobs(name),
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    from_state INTEGER NOT NULL DEFAULT 0,
    to_state INTEGER NOT NULL DEFAULT 0,
    step INTEGER NOT NULL DEFAULT -1,
    rank INTEGER NOT NULL DEFAULT -1,
    node TEXT NOT NULL DEFAULT '',
    restart INTEGER NOT NULL DEFAULT 0,
    cause TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT '',
    loss REAL,
    tokens_per_s REAL,
    detail_json TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_job ON events(job, seq);
CREATE INDEX IF NOT EXISTS events_job_kind ON events(job, kind, seq);
CREATE TABLE IF NOT EXISTS offsets (
    job TEXT NOT NULL,
    path TEXT NOT NULL,
    offset INTEGER NOT NULL,
    PRIMARY KEY (job, path)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    phase TEXT NOT NULL,
    path TEXT NOT NULL,
    time REAL NOT NULL,
    blocked_s REAL NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (job, step)
);
"""
# Columns added after the first release: (table, column, declaration), added to older files.
_ADDED_COLUMNS = (
    ("jobs", "job_id", "TEXT NOT NULL DEFAULT ''"),           # unique id (checkpoints/identity)
    ("checkpoints", "detail", "TEXT NOT NULL DEFAULT ''"),    # why skipped/corrupt/failed/...
    ("jobs", "leader", "TEXT NOT NULL DEFAULT ''"),           # etcd mode: who leads it now
    ("jobs", "listed_seq", "INTEGER NOT NULL DEFAULT 0"),     # place in listings (job_pages)
    ("jobs", "memory_snapshot_step", "INTEGER NOT NULL DEFAULT -1"),  # newest held_in_memory
    ("jobs", "restarts_in_a_row", "INTEGER NOT NULL DEFAULT 0"),  # the budget's (policies.py)
    ("jobs", "progress_mark", "INTEGER NOT NULL DEFAULT -1"),  # last_ckpt_step at the last one
)

# Checkpoint index phases (docs/architecture.md): what the workers reported or the store showed.
# A report never turns a committed row into anything but `skipped` (a restore passed it over) or
# `deleted` (retention removed it), and a save or upload attempt of the same step (`saved`,
# `failed`, `abandoned`) never hides that a committed or skipped checkpoint is in the store;
# the reconciliation with the store (daemon/ckpt_index.py) sets whatever the store proves.
_KEPT = ("phase IN ('committed', 'skipped') AND excluded.phase IN ('saved', 'failed', "
         "'abandoned')")
_PHASE_UPSERT = (
    f"phase=CASE WHEN {_KEPT} THEN phase ELSE excluded.phase END, "
    f"detail=CASE WHEN {_KEPT} THEN detail ELSE excluded.detail END")

# Event kinds kept to a job's newest `events_kept` each (the rest are the job's history).
PRUNED_KINDS = (EventKind.STEP, EventKind.CHECKPOINT)
EVENTS_KEPT = 100_000  # default of ds3dd --events-kept
PRUNE_EVERY = 1000     # new events of those kinds in a job between two prunings of it

# done_reason (and event cause) of a job whose stored row this ds3dd could not read.
QUARANTINED = "quarantined"

# Columns a caller may set through `update`/`transition`/`ingest` (never the name or config).
_MUTABLE = {
    "desired_state", "message", "step", "loss", "tokens_per_s", "step_time_s", "world_size",
    "restarts", "attempt", "last_ckpt_step", "agent_pid", "agent_started", "rdzv_pid",
    "rdzv_started", "rdzv_port", "command_id", "command_action", "command_acked",
    "rollback_step", "done_reason", "next_launch_at", "leader", "config_json",
    "memory_snapshot_step", "restarts_in_a_row", "progress_mark",
}


@dataclass(frozen=True)
class Job:
    """A row of `jobs`: what the daemon knows about one job, as of the last commit."""

    name: str
    config_json: str
    state: JobState
    desired_state: JobState
    node: str
    run_dir: str
    created_at: float
    updated_at: float
    message: str
    step: int
    loss: float | None
    tokens_per_s: float
    step_time_s: float
    world_size: int
    restarts: int
    attempt: int
    last_ckpt_step: int
    agent_pid: int
    agent_started: float
    rdzv_pid: int
    rdzv_started: float
    rdzv_port: int
    command_id: int
    command_action: str
    command_acked: int
    rollback_step: int
    done_reason: str
    next_launch_at: float
    job_id: str = ""  # unique id, in its store prefix and manifests (checkpoints/identity.py)
    # etcd mode (daemon/job_leadership.py): the address of the daemon that leads the job now
    # when it is not this one ("" while this daemon leads it)
    leader: str = ""
    # its place in listings (ListJobs pages, daemon/job_pages.py): 1 + the highest of the jobs
    # stored before it, given at creation; never the wall clock, which may step back
    listed_seq: int = 0
    # the step of the newest memory-only snapshot rank 0 reported (checkpoint.memory_interval;
    # -1: none): each one's figure, as only the first of a worker group is an event (reports.py)
    memory_snapshot_step: int = -1
    # the restart budget's count (daemon/policies.py): restarts since the job last made
    # progress, and the newest committed checkpoint step at the last restart (-1: none)
    restarts_in_a_row: int = 0
    progress_mark: int = -1

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Job:
        d = dict(row)
        d["state"] = JobState(d["state"])
        d["desired_state"] = JobState(d["desired_state"])
        return cls(**d)


@dataclass(frozen=True)
class Event:
    """A row of `events`. `seq` orders all events of the daemon; `detail` is the source record."""

    seq: int
    job: str
    time: float
    kind: str
    from_state: int = 0
    to_state: int = 0
    step: int = -1
    rank: int = -1
    node: str = ""
    restart: int = 0
    cause: str = ""
    message: str = ""
    loss: float | None = None
    tokens_per_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointRow:
    job: str
    step: int
    phase: str
    path: str
    time: float
    blocked_s: float
    detail: str = ""


_EVENT_COLS = ("job", "time", "kind", "from_state", "to_state", "step", "rank", "node",
               "restart", "cause", "message", "loss", "tokens_per_s", "detail_json")


class Store:
    """All durable state of one daemon. Thread-safe; every public write is one transaction."""

    def __init__(self, path: str | Path, events_kept: int = EVENTS_KEPT,
                 prune_every: int = PRUNE_EVERY) -> None:
        if events_kept < 1 or prune_every < 1:
            raise ValueError(f"events_kept and prune_every must be at least 1, not "
                             f"{events_kept} and {prune_every}")
        self.events_kept = events_kept
        self.prune_every = prune_every
        self._unpruned: dict[str, int] = {}  # job -> PRUNED_KINDS events since its last pruning
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                       timeout=30)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(SCHEMA)
            for table, column, decl in _ADDED_COLUMNS:
                have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
                if column not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            self._number_unlisted_jobs()
        except sqlite3.DatabaseError as e:  # not a database, damaged, read-only, locked
            raise StateError(
                f"the state database {self.path} cannot be used ({e}); if another ds3dd uses "
                "this --state-dir, stop it first; if the file is damaged or not ds3d's, move it "
                "aside and start again (this daemon then knows no jobs: their folders stay in "
                f"{self.path.parent / 'jobs'})") from None

    def _number_unlisted_jobs(self) -> None:
        """Jobs stored without a place in listings (by a ds3dd before `listed_seq`, or a row
        written by hand) get theirs in the order it listed them, (created_at, name), after
        every numbered job; then the index ListJobs reads."""
        with self._tx() as db:
            db.execute("DROP INDEX IF EXISTS jobs_listed")  # the (created_at, name) order's
            top = db.execute("SELECT COALESCE(MAX(listed_seq), 0) FROM jobs").fetchone()[0]
            unlisted = db.execute("SELECT name FROM jobs WHERE listed_seq <= 0 "
                                  "ORDER BY created_at, name").fetchall()
            db.executemany("UPDATE jobs SET listed_seq=? WHERE name=?",
                           [(top + i, row[0]) for i, row in enumerate(unlisted, 1)])
            db.execute("CREATE INDEX IF NOT EXISTS jobs_by_listed_seq ON jobs(listed_seq)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction (takes the write lock up front: no upgrade deadlocks)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._prune_due(self._db)
                self._db.execute("COMMIT")
            except BaseException:
                # a COMMIT refused (disk full) leaves the transaction open, and SQLite may have
                # rolled it back itself: either way none may stay open for the next BEGIN
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            self.changed.notify_all()

    # ---- jobs ------------------------------------------------------------------------------

    def create_job(self, name: str, config_json: str, node: str, run_dir: str,
                   message: str = "accepted", job_id: str = "") -> Job:
        """Stores a new PENDING job and its first event; AlreadyExistsError if the name is taken
        (names are never reused: the job directory and its history keep the name). Its
        `listed_seq` is one above every stored job's (jobs are never deleted, and the write lock
        is held: no number is given twice), whatever the wall clock says."""
        now = time.time()
        with self._tx() as db:
            self._check_name_free(db, name)
            db.execute(
                "INSERT INTO jobs (name, config_json, state, desired_state, node, run_dir, "
                "created_at, updated_at, message, job_id, listed_seq) VALUES "
                "(?,?,?,?,?,?,?,?,?,?,(SELECT COALESCE(MAX(listed_seq), 0) + 1 FROM jobs))",
                (name, config_json, JobState.PENDING.value, JobState.RUNNING.value, node, run_dir,
                 now, now, message, job_id))
            self._insert_event(db, {"job": name, "time": now, "kind": EventKind.STATE, "node": node,
                                    "to_state": JobState.PENDING.value, "message": message})
        return self.get_job(name)

    def check_name_free(self, name: str) -> None:
        """AlreadyExistsError if a job of this name is stored (checked again by create_job)."""
        with self._lock:
            self._check_name_free(self._db, name)

    @staticmethod
    def _check_name_free(db: sqlite3.Connection, name: str) -> None:
        row = db.execute("SELECT state FROM jobs WHERE name=?", (name,)).fetchone()
        if row is not None:
            state = JobState(row[0]).name if row[0] in {s.value for s in JobState} else row[0]
            raise AlreadyExistsError(f"a job named {name!r} already exists (it is {state}); "
                                     "choose another name with --name")

    def get_job(self, name: str) -> Job:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE name=?", (name,)).fetchone()
        if row is None:
            raise NotFoundError(f"no job named {name!r}; `ds3dctl list` shows the known jobs")
        return Job.from_row(row)

    def has_job(self, name: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM jobs WHERE name=?", (name,)).fetchone() \
                is not None

    def list_jobs(self) -> list[Job]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY listed_seq").fetchall()
        return [Job.from_row(r) for r in rows]

    def list_jobs_page(self, after_seq: int | None, limit: int,
                       include_finished: bool) -> list[Job]:
        """At most `limit` jobs in listing order (`listed_seq`) after `after_seq` (None: from
        the first), without the finished ones unless `include_finished`: one ListJobs page read
        by its index, whatever the number of jobs stored."""
        where: list[str] = []
        params: list[Any] = []
        if after_seq is not None:
            where.append("listed_seq > ?")
            params.append(after_seq)
        if not include_finished:
            where.append(f"state NOT IN ({','.join('?' * len(TERMINAL))})")
            params += [s.value for s in TERMINAL]
        sql = ("SELECT * FROM jobs" + (" WHERE " + " AND ".join(where) if where else "")
               + " ORDER BY listed_seq LIMIT ?")
        with self._lock:
            rows = self._db.execute(sql, (*params, limit)).fetchall()
        return [Job.from_row(r) for r in rows]

    def quarantine_unreadable(self, config_problem: Callable[[str], str | None]) -> list[Job]:
        """Daemon start: every job row this ds3dd cannot read (a configuration an older version
        stored that the schema now refuses, such as a NaN or a 2**63 step count, or a state
        number it does not know) ends FAILED with the cause, in one transaction per job, so
        that no stored job can take down the daemon, ListJobs or GetJob. The stored
        configuration is kept as it was, for the operator. Returns the jobs quarantined (their
        processes are the caller's to end)."""
        with self._lock:
            rows = self._db.execute("SELECT name, config_json, state, desired_state, done_reason "
                                    "FROM jobs").fetchall()
        names = []
        for r in rows:
            if r["done_reason"] == QUARANTINED:
                continue
            known = {s.value for s in JobState}
            cause: str | None
            if r["state"] not in known or r["desired_state"] not in known:
                cause = f"unknown state number {r['state']}/{r['desired_state']}"
            else:
                cause = config_problem(r["config_json"])
            if cause is None:
                continue
            was = JobState(r["state"]).name if r["state"] in known else str(r["state"])
            message = (f"quarantined at daemon start (was {was}): this ds3dd cannot read the "
                       f"stored job: {cause}; start it again under a new name with a valid "
                       "configuration (docs/runbook.md: quarantined jobs)")
            now = time.time()
            with self._tx() as db:
                db.execute("INSERT INTO transitions (job, from_state, to_state, time, message) "
                           "VALUES (?,?,?,?,?)", (r["name"], r["state"], JobState.FAILED.value,
                                                  now, message))
                db.execute("UPDATE jobs SET state=?, desired_state=?, done_reason=?, message=?, "
                           "updated_at=? WHERE name=?",
                           (JobState.FAILED.value, JobState.FAILED.value, QUARANTINED,
                            message, now, r["name"]))
                self._insert_event(db, {"job": r["name"], "time": now, "kind": EventKind.STATE,
                                        "from_state": r["state"],
                                        "to_state": JobState.FAILED.value,
                                        "cause": QUARANTINED, "message": message})
            names.append(r["name"])
        return [self.get_job(n) for n in names]

    def transition(self, name: str, dst: JobState, message: str, *, cause: str = "",
                   kind: EventKind = EventKind.STATE, **fields: Any) -> Job:
        """Moves a job to `dst` (checked against the table) with its transition row, its event and
        any column updates, all in one transaction. Raises StateError if not allowed. A job
        that ends has nothing left to drive towards: its desired state becomes the end state
        (a COMPLETED job no longer reads "desired RUNNING")."""
        now = time.time()
        if dst in TERMINAL:
            fields.setdefault("desired_state", dst)
        with self._tx() as db:
            job = self._job_locked(db, name)
            check_transition(name, job.state, dst)
            db.execute("INSERT INTO transitions (job, from_state, to_state, time, message) "
                       "VALUES (?,?,?,?,?)", (name, job.state.value, dst.value, now, message))
            self._update(db, name, {**fields, "message": message}, state=dst.value,
                         updated_at=now)
            self._insert_event(db, {"job": name, "time": now, "kind": kind, "node": job.node,
                                    "from_state": job.state.value, "to_state": dst.value,
                                    "step": job.step, "restart": job.restarts, "cause": cause,
                                    "message": message})
        return self.get_job(name)

    def record(self, name: str, kind: EventKind, message: str, status: str | None = None,
               **fields: Any) -> Job:
        """Stores an intent or a fact that is not a state change (a command sent, a process
        started) as column updates plus one event, in one transaction. `status`: the job's
        status line (its `message` column) set in that same transaction."""
        now = time.time()
        event_fields = {k: fields.pop(k) for k in ("cause", "step", "rank", "detail")
                        if k in fields}
        if status is not None:
            fields["message"] = status
        with self._tx() as db:
            job = self._job_locked(db, name)
            self._update(db, name, fields)
            detail = event_fields.pop("detail", {})
            self._insert_event(db, {"job": name, "time": now, "kind": kind, "node": job.node,
                                    "restart": job.restarts, "message": message,
                                    "step": event_fields.get("step", job.step),
                                    "detail_json": json.dumps(detail),
                                    **{k: v for k, v in event_fields.items() if k != "step"}})
        return self.get_job(name)

    def request_rollback(self, name: str, step: int, message: str) -> Job:
        """A rollback to `step` as the job's next start (the supervisor's ROLLBACK handler kills
        the workers and restarts them from it): a REQUEST event, and the commands pending for
        the workers it replaces acknowledged, never delivered to the new ones."""
        with self._lock:  # the command number read and written in one go (an RLock)
            job = self.get_job(name)
            return self.record(name, EventKind.REQUEST, message, step=step,
                               desired_state=JobState.RUNNING, rollback_step=step,
                               command_id=job.command_id + 1, command_action="",
                               command_acked=job.command_id + 1)

    def import_events(self, name: str, events: Iterable[dict[str, Any]]) -> int:
        """Events another daemon recorded (a job taken over from its lost leader, whose events
        came through etcd), stored in their order before this daemon's own; returns how many."""
        n = 0
        with self._tx() as db:
            self._job_locked(db, name)
            for ev in events:
                row = {c: ev[c] for c in _EVENT_COLS if c in ev and c not in ("job",
                                                                               "detail_json")}
                self._insert_event(db, {**row, "job": name, "detail": ev.get("detail", {})})
                n += 1
        return n

    def update(self, name: str, **fields: Any) -> Job:
        """Column updates without an event (process bookkeeping the user need not see)."""
        with self._tx() as db:
            self._job_locked(db, name)
            self._update(db, name, fields)
        return self.get_job(name)

    # ---- report ingestion --------------------------------------------------------------------

    def offsets(self, name: str) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT path, offset FROM offsets WHERE job=?",
                                    (name,)).fetchall()
        return {r["path"]: r["offset"] for r in rows}

    def ingest(self, name: str, offsets: dict[str, int], events: Iterable[dict[str, Any]],
               checkpoints: Iterable[dict[str, Any]] = (), **fields: Any) -> None:
        """Stores events derived from report records, the offsets just past those records, the
        checkpoints they announced and the job's new figures (step, loss...) in ONE transaction."""
        with self._tx() as db:
            self._job_locked(db, name)
            for ev in events:
                self._insert_event(db, {"job": name, **ev})
            for ck in checkpoints:
                db.execute(
                    "INSERT INTO checkpoints (job, step, phase, path, time, blocked_s, detail) "
                    "VALUES (?,?,?,?,?,?,?) ON CONFLICT(job, step) DO UPDATE SET "
                    f"{_PHASE_UPSERT}, "
                    "path=CASE WHEN excluded.path='' THEN path "
                    "ELSE excluded.path END, time=excluded.time, "
                    "blocked_s=MAX(blocked_s, excluded.blocked_s)",
                    (name, ck["step"], ck["phase"], ck.get("path", ""), ck["time"],
                     ck.get("blocked_s", 0.0), ck.get("detail", "")))
            for path, off in offsets.items():
                db.execute("INSERT INTO offsets (job, path, offset) VALUES (?,?,?) "
                           "ON CONFLICT(job, path) DO UPDATE SET offset=excluded.offset",
                           (name, path, off))
            if fields:
                self._update(db, name, fields)

    def forget_offsets(self, name: str, paths: Iterable[str]) -> None:
        """Drops the offset rows of report segments deleted once read (daemon/reports.py)."""
        with self._tx() as db:
            db.executemany("DELETE FROM offsets WHERE job=? AND path=?",
                           [(name, p) for p in paths])

    # ---- queries -----------------------------------------------------------------------------

    def events(self, *, job: str = "", after_seq: int = 0, kinds: Iterable[EventKind] = (),
               limit: int = 1000, cause: str = "") -> list[Event]:
        sql = "SELECT * FROM events WHERE seq > ?"
        args: list[Any] = [after_seq]
        if job:
            sql += " AND job = ?"
            args.append(job)
        if cause:
            sql += " AND cause = ?"
            args.append(cause)
        kinds = list(kinds)
        if kinds:
            sql += f" AND kind IN ({','.join('?' * len(kinds))})"
            args.extend(kinds)
        sql += " ORDER BY seq LIMIT ?"
        args.append(limit)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["detail"] = json.loads(d.pop("detail_json") or "{}")
            out.append(Event(**d))
        return out

    def transitions(self, name: str) -> list[tuple[JobState, JobState, str]]:
        with self._lock:
            rows = self._db.execute("SELECT from_state, to_state, message FROM transitions "
                                    "WHERE job=? ORDER BY id", (name,)).fetchall()
        return [(JobState(r[0]), JobState(r[1]), r[2]) for r in rows]

    def count_events(self, name: str, kind: EventKind) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM events WHERE job=? AND kind=?",
                                        (name, kind)).fetchone()[0])

    def seconds_in(self, name: str, states: Iterable[JobState], now: float | None = None) -> float:
        """Wall seconds the job has spent in `states`, from its transitions (the current
        state counted up to `now`)."""
        wanted = {s.value for s in states}
        with self._lock:
            rows = self._db.execute("SELECT to_state, time FROM transitions WHERE job=? "
                                    "ORDER BY id", (name,)).fetchall()
        total, end = 0.0, time.time() if now is None else now
        for (state, since), nxt in zip(rows, [*rows[1:], None], strict=True):
            if state in wanted:
                total += max(0.0, (nxt[1] if nxt is not None else end) - since)
        return total

    def reconcile_checkpoints(self, name: str, rows: Iterable[dict[str, Any]],
                              events: Iterable[dict[str, Any]]) -> None:
        """What the store proved about the index (daemon/ckpt_index.py): each row's phase and
        detail set as given (path and blocked time kept), with one event per change, in one
        transaction."""
        with self._tx() as db:
            self._job_locked(db, name)
            for ck in rows:
                db.execute(
                    "INSERT INTO checkpoints (job, step, phase, path, time, detail) "
                    "VALUES (?,?,?,?,?,?) ON CONFLICT(job, step) DO UPDATE SET "
                    "phase=excluded.phase, detail=excluded.detail",
                    (name, ck["step"], ck["phase"], ck.get("path", ""), ck["time"],
                     ck.get("detail", "")))
            for ev in events:
                self._insert_event(db, {"job": name, **ev})

    def checkpoints(self, name: str) -> list[CheckpointRow]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM checkpoints WHERE job=? ORDER BY step",
                                    (name,)).fetchall()
        return [CheckpointRow(**dict(r)) for r in rows]

    def wait_for_change(self, timeout: float) -> None:
        """Blocks until the next commit or `timeout` seconds (for followers of the event log)."""
        with self.changed:
            self.changed.wait(timeout)

    # ---- internals ---------------------------------------------------------------------------

    def _job_locked(self, db: sqlite3.Connection, name: str) -> Job:
        row = db.execute("SELECT * FROM jobs WHERE name=?", (name,)).fetchone()
        if row is None:
            raise NotFoundError(f"no job named {name!r}; `ds3dctl list` shows the known jobs")
        return Job.from_row(row)

    @staticmethod
    def _update(db: sqlite3.Connection, name: str, fields: dict[str, Any],
                **internal: Any) -> None:
        bad = set(fields) - _MUTABLE
        if bad:
            raise ValueError(f"not a mutable job column: {sorted(bad)}")
        values = {k: (v.value if isinstance(v, JobState) else v) for k, v in fields.items()}
        values.update(internal)
        if values:
            cols = ", ".join(f"{k}=?" for k in values)
            db.execute(f"UPDATE jobs SET {cols} WHERE name=?", (*values.values(), name))

    def _insert_event(self, db: sqlite3.Connection, ev: dict[str, Any]) -> None:
        if "detail" in ev:
            ev = {**ev, "detail_json": json.dumps(ev.pop("detail"), default=str)}
        cols = [c for c in _EVENT_COLS if c in ev]
        db.execute(f"INSERT INTO events ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                   [ev[c] for c in cols])
        if ev.get("kind") in PRUNED_KINDS:
            self._unpruned[ev["job"]] = self._unpruned.get(ev["job"], 0) + 1

    def _prune_due(self, db: sqlite3.Connection) -> None:
        """In the open transaction: each job with prune_every new events of PRUNED_KINDS keeps
        the newest events_kept of each such kind (a restarted daemon counts from 0 again: the
        bound still holds, one batch later)."""
        for job in [j for j, n in self._unpruned.items() if n >= self.prune_every]:
            for kind in PRUNED_KINDS:
                row = db.execute("SELECT seq FROM events WHERE job=? AND kind=? ORDER BY seq "
                                 "DESC LIMIT 1 OFFSET ?", (job, kind, self.events_kept)).fetchone()
                if row is not None:
                    db.execute("DELETE FROM events WHERE job=? AND kind=? AND seq<=?",
                               (job, kind, row[0]))
            del self._unpruned[job]
