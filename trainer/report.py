"""How workers tell the daemon what they do: one append-only JSON-lines file per rank.

Why files and not a socket: a daemon that is down (restarted, upgraded, SIGKILLed) cannot receive
on a socket, but on its return it reads what the workers wrote meanwhile from the offset it had
stored. Each line is one complete JSON object written with a single `write` + flush, so a reader
never sees half a record except possibly the last line of a file being written (it waits for the
newline).

Layout inside a job's run directory:
    reports/rank-00003.jsonl     records of global rank 3 (all restarts of the job append here)

Every record has: `kind`, `time` (unix seconds), `rank`, `restart` (TORCHELASTIC_RESTART_COUNT),
`node` (hostname) and `pid`. Kinds and their extra fields:
    start       world_size, tp, pp, dp, stage, dp_rank, tp_rank, device, step (resumed-from step),
                partition, process_started (unix time the process started: the group's spawn)
    step        step, loss, grad_norm, lr, loss_scale, tokens_per_s, step_time_s, samples (rank 0
                only writes `step` records; every rank writes `heartbeat`)
    heartbeat   step (the last completed step), phase ("init", "train", "save", "load")
    checkpoint  step, phase ("saved", "committed", "failed"), path, blocked_s, detail
    fault       cause ("nan", "spike", ...), step, detail
    recovery    cause, step (the failed one), recovered_to, steps_lost, skipped_batches, seconds
                (an in-process rollback)
    done        step (the last step), reason ("completed", "paused", "stopped")
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any


def report_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "reports" / f"rank-{rank:05d}.jsonl"


class Reporter:
    """Appends records for one rank. Cheap: one small write per record, no fsync (a lost tail
    after a power cut costs a few metrics, never correctness: checkpoints carry the truth)."""

    def __init__(self, run_dir: str | Path, rank: int, restart: int) -> None:
        path = report_path(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "a", buffering=1, encoding="utf-8")
        self._base = {"rank": rank, "restart": restart, "node": socket.gethostname(),
                      "pid": os.getpid()}

    def emit(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "time": round(time.time(), 3), **self._base, **fields}
        self._fh.write(json.dumps(record, separators=(",", ":"), default=float) + "\n")

    def close(self) -> None:
        self._fh.close()


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
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn line from a crashed writer; the next one is whole
    return records, offset + end
