"""How workers tell the daemon what they do: one append-only JSON-lines file per rank.

Why files and not a socket: a daemon that is down (restarted, upgraded, SIGKILLed) cannot receive
on a socket, but on its return it reads what the workers wrote meanwhile from the offset it had
stored. Each line is one complete JSON object written with a single `write` + flush, so a reader
never sees half a record except possibly the last line of a file being written (it waits for the
newline).

Layout inside a job's run directory:
    reports/rank-00003.jsonl          records of global rank 3: its first segment
    reports/rank-00003.000001.jsonl   its next segments, in order (all restarts append to the
                                      rank's newest segment)

Segments keep a weeks-long job's files bounded. A writer that finds the segment it writes at or
past `SEGMENT_BYTES` moves to the rank's newest segment, starting the next one if that is full
too; a segment, once a newer one exists, is never written again (but for a record another
writer of the same rank had already decided to put there, a moment earlier). The reader (the
daemon, daemon/reports.py) tails every segment from its own offset and deletes a segment only
once it has consumed it to the end and two newer segments of the rank exist, so at most the
rank's newest two segments (about 2 x SEGMENT_BYTES) stay once they have been read, and no
record is deleted before it was read. Segment 0 keeps the name of the one file of old.

Every record has: `kind`, `time` (unix seconds), `rank`, `restart` (TORCHELASTIC_RESTART_COUNT),
`node` (hostname) and `pid`. Kinds (`RecordKind`, trainer/kinds.py: `emit` refuses any other)
and their extra fields:
    start       world_size, tp, pp, dp, stage, dp_rank, tp_rank, device, step (resumed-from step),
                partition, process_started (unix time the process started: the group's spawn)
    step        step, loss, grad_norm, lr, loss_scale, tokens_per_s, step_time_s, samples (rank 0
                only writes `step` records; every rank writes `heartbeat`)
    heartbeat   step (the last completed step), phase ("init", "build", "load", "train", "save",
                "store_wait"); "init" carries startup_s (seconds from the process's start to
                each start-up stage: imported, config, device, process_group, layout), "load"
                build_s (the engine's build, then the wait for the read-ahead)
    checkpoint  step, phase ("saved", "local_complete", "committed", "failed", "uploaded",
                "abandoned", "skipped", "restoring", "loaded", "rolled_back", "reshaped",
                "retention", "swept", "cleanup_failed"; rank 0 only: "held_in_memory", a
                memory-only snapshot, no files, with blocked_s; "memory_snapshots_off" with cause
                and detail, step -1), path, blocked_s, cause, detail,
                durable ("restoring": false when restored from the local-complete copy or a
                memory-only snapshot), source
                ("restoring": "node_memory", "local" or "store", engine_io.RestorePlan) (the
                phases' meaning: daemon/reports.py; the two commits: checkpoints/local_complete.py)
    fault       cause ("nan", "spike", "oom", "injected_<FaultKind>", ...), step, detail
    recovery    cause, step (the failed one), recovered_to, steps_lost, skipped_batches, seconds,
                source (an in-process recovery: where a rollback read its state, "memory",
                "local" or "store"; or "skipped_update": a NaN step whose update every rank's
                optimizer skipped, undone in place, nothing read)
    done        step (the last step), reason (`DoneReason`: "completed", "paused", "stopped",
                "repartition", "restart")
    checkpoint_interval  step, interval_s and the figures it was decided from ("auto" interval,
                trainer/checkpoint_interval.py); with memory_interval "auto", memory_interval_s
                and its figures (every key prefixed memory_), in the same record
    command     id, action, status ("done", "refused"), step, detail (a daemon command, rank 0)
    profile     step, stage, partition, layers and the calibration (per-layer costs, every rank)
    repartition step, decision, source, current, proposed (stage boundaries decided, rank 0)

A full disk never stops training here: a record that does not fit is held in memory (in order,
bounded) and written before the next one once there is room; a short write is cut back so no
torn line is left. The daemon, meanwhile, diagnoses the full disk itself (daemon/disk.py) and
does not take the silence for a hang; once space returns, the held records arrive in order.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from ds3d.checkpoints.disk_space import is_disk_full, shortage

from .kinds import RecordKind

_RECORD_KINDS = frozenset(RecordKind)
HELD_RECORDS_MAX = 200_000  # records kept while the disk is full (~50 MB); the oldest go first


SEGMENT_BYTES = 16 << 20  # a rank's segment is closed once it holds this much (~50k steps)
KEPT_SEGMENTS = 2  # the newest segments of a rank kept once read (the rest are deleted)
_SEGMENT_NAME = re.compile(r"^rank-(\d{5,})(?:\.(\d{6,}))?\.jsonl$")


def report_path(run_dir: str | Path, rank: int, segment: int = 0) -> Path:
    """Segment `segment` of a rank's reports (segment 0 is the rank's first file)."""
    return Path(run_dir) / "reports" / segment_name(rank, segment)


def segment_name(rank: int, segment: int) -> str:
    return f"rank-{rank:05d}.jsonl" if segment == 0 else f"rank-{rank:05d}.{segment:06d}.jsonl"


def parse_segment_name(name: str) -> tuple[int, int] | None:
    """(rank, segment) of a report file's name; None for any other name."""
    m = _SEGMENT_NAME.match(name)
    return None if m is None else (int(m.group(1)), int(m.group(2) or 0))


def report_segments(folder: str | Path, rank: int | None = None) -> list[Path]:
    """The report segments in one folder (of `rank`, or of every rank), ordered by rank, then
    segment: the order their records were written in."""
    found = []
    for path in Path(folder).glob("rank-*.jsonl"):
        parsed = parse_segment_name(path.name)
        if parsed is not None and (rank is None or parsed[0] == rank):
            found.append((parsed, path))
    return [path for _, path in sorted(found)]


def read_rank_records(run_dir: str | Path, rank: int) -> list[dict[str, Any]]:
    """Every record of a rank still on disk, in the order written (its read segments beyond the
    newest KEPT_SEGMENTS are gone: the daemon's event table holds what they said)."""
    records: list[dict[str, Any]] = []
    for path in report_segments(Path(run_dir) / "reports", rank):
        records += read_records(path)[0]
    return records


class Reporter:
    """Appends records for one rank. Cheap: one small write per record, no fsync (a lost tail
    after a power cut costs a few metrics, never correctness: checkpoints carry the truth).
    Thread-safe (the checkpoint writer and uploader threads report too)."""

    def __init__(self, run_dir: str | Path, rank: int, restart: int,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        self._rank = rank
        self._folder = Path(run_dir) / "reports"
        self._folder.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.path = self._newest_segment()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._base = {"rank": rank, "restart": restart, "node": socket.gethostname(),
                      "pid": os.getpid()}
        self._lock = threading.Lock()
        self._held: deque[bytes] = deque()  # records waiting for room on the disk
        self._dropped = 0  # held records given up (the oldest) past HELD_RECORDS_MAX
        self._full_since: float | None = None

    def emit(self, kind: str, **fields: Any) -> None:
        """Appends one record; a `kind` outside the registry raises ValueError (the daemon
        would store it under a kind nobody looks for)."""
        if kind not in _RECORD_KINDS:
            raise ValueError(f"report record kind {kind!r} is not a RecordKind "
                             f"({', '.join(RecordKind)}): add it to trainer/kinds.py")
        record = {"kind": str(kind), "time": round(time.time(), 3), **self._base, **fields}
        line = (json.dumps(record, separators=(",", ":"), default=float) + "\n").encode()
        with self._lock:
            self._held.append(line)
            if len(self._held) > HELD_RECORDS_MAX:
                self._held.popleft()
                self._dropped += 1
            self._flush()

    def held(self) -> int:
        """Records not written yet because the disk is full."""
        with self._lock:
            return len(self._held)

    def _flush(self) -> None:
        while self._held:
            if not self._append(self._held[0]):
                return
            self._held.popleft()
        if self._full_since is not None:
            _say(f"ds3d: reports are written again to {self.path} after "
                 f"{time.time() - self._full_since:.0f} s of a full disk"
                 + (f"; {self._dropped} oldest held records were dropped" if self._dropped
                    else "; no record was lost"))
            self._full_since, self._dropped = None, 0

    def _newest_segment(self) -> Path:
        """The segment to write: the rank's newest, or the one after it once that is full."""
        segments = report_segments(self._folder, self._rank)
        if not segments:
            return self._folder / segment_name(self._rank, 0)
        newest = segments[-1]
        try:
            full = newest.stat().st_size >= self.segment_bytes
        except FileNotFoundError:
            full = False
        if not full:
            return newest
        _, segment = parse_segment_name(newest.name) or (self._rank, 0)
        return self._folder / segment_name(self._rank, segment + 1)

    def _next_segment(self) -> None:
        """The segment written is full: on to the rank's newest (another writer of this rank
        may have started it already), or a new one."""
        path = self._newest_segment()
        if path == self.path:
            return
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.close(self._fd)
        self._fd, self.path = fd, path

    def _append(self, line: bytes) -> bool:
        """One whole line or nothing: False (with the file as it was) when the disk is full."""
        start: int | None = None
        try:
            if os.fstat(self._fd).st_size >= self.segment_bytes:
                self._next_segment()
            start = os.fstat(self._fd).st_size
            written = os.write(self._fd, line)
            if written == len(line):
                return True
            raise OSError(28, "No space left on device (short write)")
        except OSError as e:
            if not is_disk_full(e):
                raise
            try:
                if start is not None:  # (None: no room to start the next segment)
                    os.ftruncate(self._fd, start)  # no torn line for the daemon to skip
            except OSError:
                pass
            if self._full_since is None:
                self._full_since = time.time()
                _say("ds3d: " + shortage(self.path, len(line)).message("this rank's reports")
                     + "; records are held in memory and written once there is room")
            return False

    def close(self, wait_s: float = 600.0) -> None:
        """Writes what is held; while the disk stays full, waits up to `wait_s` for room (the
        last records, `done` above all, are how the daemon learns the job finished)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            self._flush()
            if self._held:
                _say(f"ds3d: waiting up to {wait_s:.0f} s for room to write this rank's last "
                     f"{len(self._held)} records to {self.path}")
            while self._held and time.monotonic() < deadline:
                time.sleep(1.0)
                self._flush()
            os.close(self._fd)


def _say(text: str) -> None:
    """To stderr, if it can be written (on a full disk the log file may not be)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass


def read_records(path: str | Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Complete records after byte `offset`, and the offset to resume from next time."""
    records: list[dict[str, Any]] = []
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return records, offset
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:  # JSONDecodeError, or bytes that are no text at all
                continue  # a torn line from a crashed writer; the next one is whole
            if isinstance(record, dict):  # anything else is no record of ours
                records.append(record)
    return records, offset + end
