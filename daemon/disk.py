"""Full disks under a job, diagnosed by the daemon within a tick, before they look like a hang.

A full disk stops things quietly: workers cannot append reports (so the daemon hears nothing),
checkpoints cannot be written, SQLite refuses every write ("database or disk is full"). Left to
the other detectors, that silence became a hang, a restart that could not launch, and a job
RECOVERING for good (issue 19). `DiskWatch` instead looks at the free space (`os.statvfs`, a few
microseconds) of every place a job writes, once a second:

    state       the daemon's state directory (SQLite, its log)
    job         the job's directory (reports, control files, worker logs)
    local tier  `checkpoint.local_dir` (default JOB_DIR/ckpt) and a `file://` store

Each file system short of what it needs gets one `diagnosis` event (cause `disk_full`) naming
the paths on it, the bytes free and the bytes needed; when it has room again, one more
(cause `disk_space_back`). What is needed: `reserve_bytes` everywhere (room for reports,
control files and SQLite pages), and on the local tier's file system also the size of this
node's newest checkpoint there (the next save needs as much). While the job's reports cannot
be written (free below the reserve), `blocking()` is true and the supervisor does not take the
silence for a hang: the workers keep training (trainer/report.py holds their records) and
everything resumes by itself once space returns.

The state directory may be the full one. A diagnosis that cannot be stored then is logged at
once and stored as soon as it can; to make that soon, the watch keeps a small ballast file in
the state directory (`ds3dd.reserve`) and deletes it when that disk is full, so that the
diagnosis and the job's status line get written; it is made again once the disk has room.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds3d.checkpoints.disk_space import existing_ancestor, human, is_disk_full, mount_point
from ds3d.trainer.config import JobConfig
from ds3d.trainer.kinds import EventKind

from .logging import get_logger
from .store import Job, Store

DEFAULT_RESERVE_BYTES = 16 << 20
BALLAST_BYTES = 4 << 20
BALLAST_NAME = "ds3dd.reserve"
SILENCE_GRACE_S = 30.0
_TAG_PREFIX = "global_step"


@dataclass
class _Disk:
    """One file system and the job's paths on it."""

    device: int
    mount: str
    paths: dict[str, str] = field(default_factory=dict)  # role -> path
    needed: int = 0
    free: int = 0
    reason: str = ""  # what `needed` is made of


@dataclass(frozen=True)
class DiskNote:
    """A diagnosis to store: a disk became full, or has room again."""

    cause: str  # "disk_full" | "disk_space_back"
    message: str
    detail: dict[str, Any]
    detected_at: float


class DiskWatch:
    def __init__(self, store: Store, job_name: str, state_dir: Path,
                 config: Callable[[Job], JobConfig],
                 reserve_bytes: int = DEFAULT_RESERVE_BYTES, interval_s: float = 1.0) -> None:
        self.store, self.name, self.state_dir = store, job_name, Path(state_dir)
        self.config = config
        self.reserve_bytes = reserve_bytes
        self.interval_s = interval_s
        self.log = get_logger("ds3d.disk", job=job_name)
        self._next = 0.0
        self._short: dict[int, _Disk] = {}  # device -> the disk while it is short of space
        self._unstored: list[DiskNote] = []
        self._ckpt_size: tuple[str, int] = ("", 0)  # newest local tag -> its bytes (cached)
        self._last_write_error = 0.0
        self._blocked_until = 0.0

    # -- the supervisor's hooks ---------------------------------------------------------------

    def tick(self, job: Job) -> None:
        """Measures (at most once per interval) and stores what changed. Never raises for a
        full disk: what cannot be stored now is kept and stored on a later tick."""
        now = time.monotonic()
        try:
            if now >= self._next:
                self._next = now + self.interval_s
                self._unstored += self._measure(job)
            self._store_notes()
        except Exception:  # noqa: BLE001 - a diagnostic must never stop the job's supervision
            self.log.exception("disk watch failed; supervision goes on")

    def blocking(self) -> bool:
        """A disk the job's reports or the daemon's state live on is full, or was within the
        last `SILENCE_GRACE_S` (the workers write what they held at their next record):
        silence from the workers is explained, not a hang."""
        if any(d.free < self.reserve_bytes and ({"state", "job"} & set(d.paths))
               for d in self._short.values()):
            self._blocked_until = time.monotonic() + SILENCE_GRACE_S
            return True
        return time.monotonic() < self._blocked_until

    def write_failed(self, exc: BaseException) -> None:
        """The supervisor's own write failed for a full disk: one short log line (at most
        every 10 s) instead of a traceback per tick; the diagnosis comes from `tick`."""
        now = time.monotonic()
        if now - self._last_write_error >= 10.0:
            self._last_write_error = now
            self._next = 0.0  # measure on the next tick
            self.log.error("supervisor write failed: disk full; retrying when there is room",
                           error=str(exc), state_dir=str(self.state_dir))

    # -- measuring ------------------------------------------------------------------------------

    def _disks(self, job: Job) -> dict[int, _Disk]:
        run_dir = Path(job.run_dir)
        try:
            cfg: JobConfig | None = self.config(job)
        except Exception:  # noqa: BLE001 - an unreadable config is another detector's fault
            cfg = None
        roles = {"state": self.state_dir, "job": run_dir}
        local = Path(cfg.checkpoint.local_dir) if cfg and cfg.checkpoint.local_dir \
            else run_dir / "ckpt"
        roles["local tier"] = local
        if cfg and cfg.checkpoint.store and cfg.checkpoint.store.startswith("file://"):
            roles["file store"] = Path(cfg.checkpoint.store[len("file://"):])
        disks: dict[int, _Disk] = {}
        for role, path in roles.items():
            try:
                where = existing_ancestor(path)
                st = os.statvfs(where)
                device = os.stat(where).st_dev
            except OSError:
                continue
            disk = disks.get(device)
            if disk is None:
                disk = disks[device] = _Disk(device, str(mount_point(where)),
                                             free=st.f_bavail * st.f_frsize)
            disk.paths[role] = str(path)
        for disk in disks.values():
            # the reserve is for what the state directory and the job directory hold: a disk
            # with only the local tier (or a file store) on it needs room for checkpoints only
            parts = [f"{human(self.reserve_bytes)} for reports, control files and the "
                     "daemon's database"] if _holds_writes(disk) else []
            disk.needed = self.reserve_bytes if _holds_writes(disk) else 0
            if "local tier" in disk.paths:
                size = self._newest_checkpoint_bytes(Path(disk.paths["local tier"]))
                if size:
                    disk.needed += size
                    parts.append(f"{human(size)} for the next checkpoint (the newest one here)")
            disk.reason = " + ".join(parts) or "room for the next checkpoint"
        return disks

    def _newest_checkpoint_bytes(self, local: Path) -> int:
        try:
            tags = [p for p in local.iterdir() if p.name.startswith(_TAG_PREFIX)
                    and p.name[len(_TAG_PREFIX):].isdigit()]
        except OSError:
            return 0
        if not tags:
            return 0
        newest = max(tags, key=lambda p: int(p.name[len(_TAG_PREFIX):]))
        if self._ckpt_size[0] != str(newest):
            total = 0
            for dirpath, _dirs, names in os.walk(newest):
                for n in names:
                    try:
                        total += os.stat(os.path.join(dirpath, n)).st_size
                    except OSError:
                        continue
            self._ckpt_size = (str(newest), total)
        return self._ckpt_size[1]

    def _measure(self, job: Job) -> list[DiskNote]:
        notes: list[DiskNote] = []
        disks = self._disks(job)
        for device, disk in disks.items():
            was = self._short.get(device)
            if disk.free < disk.needed:
                self._short[device] = disk
                if was is None:
                    notes.append(self._full_note(disk))
            elif was is not None:
                del self._short[device]
                notes.append(self._back_note(disk, was))
        if any("state" in d.paths for d in self._short.values()):
            self._drop_ballast()
        elif self.state_dir.is_dir():
            self._keep_ballast()
        return notes

    def _full_text(self, disk: _Disk) -> str:
        where = ", ".join(f"{role} {path}" for role, path in disk.paths.items())
        effect = ("reports and the daemon's writes wait for room (the workers keep training; "
                  "no hang is declared)" if disk.free < self.reserve_bytes and
                  _holds_writes(disk) else "the next checkpoint will not fit (saves fail and are "
                  "dropped; training goes on from the last one that fitted)")
        return (f"disk full: the file system at {disk.mount} ({where}) has "
                f"{human(disk.free)} free ({disk.free} bytes), {human(disk.needed)} "
                f"({disk.needed} bytes) needed: {disk.reason}; {effect}. Free space there "
                "(or move that path to a larger disk); the job goes on by itself")

    def _full_note(self, disk: _Disk) -> DiskNote:
        message = self._full_text(disk)
        self.log.error("disk_full", mount=disk.mount, paths=disk.paths, bytes_free=disk.free,
                       bytes_needed=disk.needed)
        return DiskNote("disk_full", message, {
            "mount": disk.mount, "paths": disk.paths, "path": next(iter(disk.paths.values())),
            "bytes_free": disk.free, "bytes_needed": disk.needed}, time.time())

    def _back_note(self, disk: _Disk, was: _Disk) -> DiskNote:
        message = (f"disk space is back: the file system at {disk.mount} has {human(disk.free)} "
                   f"free ({disk.free} bytes), {human(disk.needed)} needed; the job goes on")
        self.log.info("disk_space_back", mount=disk.mount, bytes_free=disk.free)
        return DiskNote("disk_space_back", message, {
            "mount": disk.mount, "paths": disk.paths, "path": next(iter(disk.paths.values())),
            "bytes_free": disk.free, "bytes_needed": disk.needed,
            "full_bytes_free": was.free}, time.time())

    # -- storing --------------------------------------------------------------------------------

    def _store_notes(self) -> None:
        while self._unstored:
            note = self._unstored[0]
            # the status line says it too, until the job's next transition; one transaction
            # with the event, so a disk that fills between the two cannot repeat the diagnosis
            still = [self._full_text(d) for d in self._short.values()]
            status = note.message if note.cause == "disk_full" or not still else still[0]
            try:
                self.store.record(self.name, EventKind.DIAGNOSIS, note.message, status=status,
                                  cause=note.cause,
                                  detail={**note.detail, "detected_at": note.detected_at})
            except sqlite3.OperationalError as e:
                if not is_disk_full(e):
                    raise
                return  # stored on a later tick
            self._unstored.pop(0)

    def _ballast(self) -> Path:
        return self.state_dir / BALLAST_NAME

    def _drop_ballast(self) -> None:
        try:
            self._ballast().unlink()
        except OSError:
            return
        self.log.warning("state directory full: released the reserve file so the diagnosis "
                         "can be stored", path=str(self._ballast()))

    def _keep_ballast(self) -> None:
        path = self._ballast()
        if path.exists():
            return
        try:
            st = os.statvfs(self.state_dir)
            if st.f_bavail * st.f_frsize < 4 * BALLAST_BYTES:
                return
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, BALLAST_BYTES)
            finally:
                os.close(fd)
        except OSError:
            path.unlink(missing_ok=True)


def _holds_writes(disk: _Disk) -> bool:
    """The disk holds the daemon's state or the job's directory (reports, control files): a
    full one holds those writes back, and silence from the workers is no hang."""
    return bool({"state", "job"} & set(disk.paths))
