"""The job directory: the contract between ds3dd and the trainer's workers.

    STATE_DIR/jobs/<name>/
        job.json                 JobConfig.dump_json(); the workers read it
        reports/rank-XXXXX.jsonl per-rank records (trainer/report.py); the daemon tails them;
                                 later segments rank-XXXXX.NNNNNN.jsonl, the read ones deleted
                                 but the rank's newest two (trainer/report.py KEPT_SEGMENTS)
        ckpt/                    local checkpoint tier (written by the workers)
        logs/                    agent.log, rendezvous.log, attempt-N/... worker stdout/stderr
        control/command.json     daemon -> workers, written as tmp + rename:
                                 {"id": n (increasing), "action": "save"|"pause"|"stop"|"stop_now"
                                  |"profile"|"repartition"|"restart", "time": unix s, ...};
                                  the actions and their extra fields: daemon/commands.py
        partition.json           the decided pipeline stage boundaries (trainer/partition.py),
                                 written by the workers, read at every start
        control/restore.json     daemon -> workers before a rollback: {"step": n, "id": n}
        control/inject.json      daemon -> workers, drills only (ds3dd --enable-fault-injection):
                                 {"id": n, "kind": k, "rank": r, "at_step": s, "time": unix s},
                                  k a FaultKind (trainer/kinds.py; trainer/faults.py acts)
        reports/nodes/<node>/rank-XXXXX[.NNNNNN].jsonl  head node only: copies of the segments
                                 written on the other nodes of a multi-node job (pulled by peer
                                 RPC), tailed and deleted like this node's own
        control/agent-N.{json,exit}  agent spec and result (launcher.py, agent.py)

Why files: a daemon that is down can still be heard on its return (reports), and workers can
read a command at a step boundary without a server of their own (command.json).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ds3d.trainer.config import JOB_NAME_RE
from ds3d.trainer.errors import ConfigError
from ds3d.trainer.fileio import atomic_write_text
from ds3d.trainer.kinds import FaultKind
from ds3d.trainer.report import report_segments

from .commands import Command

# Control files the head copies to the other nodes of a multi-node job: rank 0 (which reads
# commands) and the rank named by an injection may run on any node.
CONTROL_FILES = ("command.json", "restore.json", "inject.json", "failures.json")


class JobDir:
    """Paths and atomic writes of one job's directory."""

    def __init__(self, jobs_root: Path, name: str) -> None:
        if not JOB_NAME_RE.match(name):
            raise ConfigError(
                f"job name {name!r} is not allowed: use 1-63 characters of a-z, 0-9, '.', '_' "
                "or '-', starting with a letter or digit (it names a folder: no '/', '..' or "
                "spaces)")
        self.path = (jobs_root / name).resolve()
        if self.path.parent != jobs_root.resolve():
            raise ConfigError(f"job name {name!r} escapes the jobs folder")
        self.name = name

    @property
    def job_json(self) -> Path:
        return self.path / "job.json"

    @property
    def reports(self) -> Path:
        return self.path / "reports"

    @property
    def ckpt(self) -> Path:
        return self.path / "ckpt"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def control(self) -> Path:
        return self.path / "control"

    @property
    def command_file(self) -> Path:
        return self.control / "command.json"

    def create(self, config_json: str) -> None:
        for d in (self.reports, self.ckpt, self.logs, self.control):
            d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.job_json, config_json)

    def write_command(self, command_id: int, command: Command) -> None:
        fields = command.file_fields()
        atomic_write_text(self.command_file, json.dumps(
            {"id": command_id, "action": fields.pop("action"), "time": round(time.time(), 3),
             **fields}))

    def command(self) -> dict[str, Any] | None:
        """The command file as last written (None if none yet or unreadable)."""
        return _control_record(self.command_file)

    def write_restore(self, step: int, request_id: int) -> None:
        atomic_write_text(self.control / "restore.json",
                      json.dumps({"id": request_id, "step": step, "time": time.time()}))

    @property
    def inject_file(self) -> Path:
        return self.control / "inject.json"

    def write_inject(self, inject_id: int, kind: FaultKind, rank: int, at_step: int) -> str:
        """Writes control/inject.json atomically; returns the text written."""
        text = json.dumps({"id": inject_id, "kind": FaultKind(kind), "rank": rank,
                           "at_step": at_step, "time": round(time.time(), 3)})
        atomic_write_text(self.inject_file, text)
        return text

    def inject(self) -> dict[str, Any] | None:
        return _control_record(self.inject_file)

    def write_control(self, file: str, text: str) -> None:
        """A control file as the head wrote it (`text` "" removes it). Its shape is checked
        first: the workers act on these files at a step boundary, and one that is no JSON
        object (or has no integer id) would fail every step of every rank on this node."""
        if file not in CONTROL_FILES:
            raise ConfigError(f"control file {file!r} is not one of {', '.join(CONTROL_FILES)}")
        if text:
            try:
                record = json.loads(text)
            except ValueError:
                record = None
            if not isinstance(record, dict) or (file != "failures.json" and
                                                type(record.get("id")) is not int):
                raise ConfigError(f"control file {file}: {text[:80]!r} is not a JSON object "
                                  f"{'' if file == 'failures.json' else 'with an integer id '}"
                                  "as the head daemon writes it; nothing was written")
            atomic_write_text(self.control / file, text)
        else:
            (self.control / file).unlink(missing_ok=True)

    def report_files(self) -> list[Path]:
        """This node's rank files, then the copies pulled from other nodes (reports/nodes/),
        each folder's in rank and segment order."""
        return [path for folder in (self.reports, *sorted(self.reports.glob("nodes/*/")))
                for path in report_segments(folder)]

    def report_key(self, path: Path) -> str:
        """A report file's name in the offsets table: relative to reports/ (a local file keeps
        its bare name, as before multi-node copies existed)."""
        return str(path.relative_to(self.reports))


def _control_record(path: Path) -> dict[str, Any] | None:
    """A control file as this daemon writes it ({"id": int, "time": number, ...}), or None when
    it is missing or is not one (a file damaged or edited by hand: the next write replaces it;
    taken as it was, its fields failed every supervisor tick of the job, or InjectFault)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or type(record.get("id")) is not int:
        return None
    when = record.get("time", 0)
    return record if isinstance(when, int | float) and not isinstance(when, bool) else None
