"""structlog set-up of ds3d's plain processes: the trainer's workers and the uploader process
(`python -m ds3d.checkpoints.upload`). ds3dd has its own (daemon/logging.py: a log file, and
the standard library's logging routed through it).

JSON lines when the output is not a terminal (production, log files) or DS3D_LOG_FORMAT=json;
a readable, aligned console format on a terminal. Context bound once (job, node, rank) rides on
every line. It lives in the lowest layer, beside the disk-full test it uses, because both the
trainer and storage's own process entry configure their logging with it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog
from structlog.typing import FilteringBoundLogger

from .disk_space import is_disk_full


class FullDiskTolerantStream:
    """A log stream whose writes a full disk refuses are dropped, never raised: a worker's
    stderr is a file in the job folder (the elastic agent redirects it), and a log line is not
    worth a training run. Other errors are raised as before."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.dropped = 0  # writes lost to a full disk

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            if not is_disk_full(e):
                raise
            self.dropped += 1
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            if not is_disk_full(e):
                raise

    def isatty(self) -> bool:
        return self._stream.isatty()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def tolerate_full_disk_on_std_streams() -> None:
    """A worker's stdout and stderr are files in the job folder (the elastic agent redirects
    them): a `print` there (ours, DeepSpeed's) that a full disk refuses must not end training."""
    if not isinstance(sys.stdout, FullDiskTolerantStream):
        sys.stdout = FullDiskTolerantStream(sys.stdout)
    if not isinstance(sys.stderr, FullDiskTolerantStream):
        sys.stderr = FullDiskTolerantStream(sys.stderr)


def configure_logging(stream: TextIO | None = None, fmt: str | None = None,
                      level: str | None = None, **context: Any) -> FilteringBoundLogger:
    """Configures structlog for this process (once, at its entry) to write to `stream`
    (stderr by default); `context` (rank, restart, ...) is bound to every line."""
    stream = stream or sys.stderr
    fmt = fmt or os.environ.get("DS3D_LOG_FORMAT") or ("console" if stream.isatty() else "json")
    renderer: Any = (structlog.processors.JSONRenderer() if fmt == "json"
                     else structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    name = (level or os.environ.get("DS3D_LOG_LEVEL", "INFO")).upper()
    lvl = getattr(logging, name, logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            (structlog.processors.dict_tracebacks if fmt == "json"
             else structlog.processors.format_exc_info),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(
            file=FullDiskTolerantStream(stream)),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**{k: v for k, v in context.items() if v is not None})
    logger: FilteringBoundLogger = structlog.get_logger()
    return logger
