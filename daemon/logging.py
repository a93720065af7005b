"""Structured logging for ds3dd: JSON lines in the daemon log, readable lines on a terminal.

Why structlog with a fixed set of keys: events are data (job, node, rank, step, restart, cause),
so a log line can be filtered and joined with the event table instead of being parsed out of
prose. The node name is bound once at start; loggers for a job bind `job`, and calls add `rank`
and `step` where they are known.

The standard library `logging` module is routed through the same processors, so messages of
grpc and torch land in the same file in the same format.

The file is rotated by size (`--log-max-mb`, `--log-backups`: ds3dd.log, ds3dd.log.1 ...), so a
weeks-long daemon keeps at most (backups + 1) x max bytes of log. One process writes it: the
ds3dd holding the state directory's lock (agents and workers log to their job's logs/ folder),
so the standard library's single-process RotatingFileHandler is correct. It opens the file at
the first record, so a second ds3dd refused the state directory's lock never touches it.
"""

from __future__ import annotations

import logging as _stdlib_logging
import logging.handlers as _stdlib_handlers
import sys
from pathlib import Path
from typing import Any

import structlog

_configured = False
LOG_MAX_BYTES = 100 << 20  # default size at which ds3dd.log is rotated (--log-max-mb)
LOG_BACKUPS = 5            # default rotated files kept: ds3dd.log.1 ... .5 (--log-backups)


def configure(log_file: str | Path | None, node: str, level: str = "info",
              console: bool | None = None, max_bytes: int = LOG_MAX_BYTES,
              backups: int = LOG_BACKUPS) -> None:
    """Sets up structlog once per process. `log_file` gets JSON lines, rotated once it reaches
    `max_bytes` with `backups` older files kept (both at least 1: the standard handler never
    rotates with 0 of either); stderr gets a console rendering when it is a TTY (or
    `console=True`), JSON otherwise."""
    if max_bytes < 1 or backups < 1:
        raise ValueError(f"log rotation needs max_bytes and backups of at least 1, not "
                         f"{max_bytes} and {backups}")
    global _configured
    lvl = getattr(_stdlib_logging, level.upper(), _stdlib_logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    root = _stdlib_logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.setLevel(lvl)
    use_console = sys.stderr.isatty() if console is None else console
    stderr_handler = _stdlib_logging.StreamHandler(sys.stderr)
    stderr_handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.dev.ConsoleRenderer(colors=False) if use_console
                    else structlog.processors.JSONRenderer()]))
    root.addHandler(stderr_handler)
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        file_handler = _stdlib_handlers.RotatingFileHandler(
            log_file, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", delay=True)
        file_handler.setFormatter(structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.processors.format_exc_info,
                        structlog.processors.JSONRenderer()]))
        root.addHandler(file_handler)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(node=node)
    _configured = True


def get_logger(name: str = "ds3d", **bind: Any) -> Any:
    """A bound structlog logger; pass job=..., rank=..., step=... where known."""
    return structlog.get_logger(name).bind(**bind)
