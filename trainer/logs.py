"""structlog set-up shared by workers, the daemon and the CLI.

JSON lines when the output is not a terminal (production, log files) or DS3D_LOG_FORMAT=json;
a readable, aligned console format on a terminal. Context bound once (job, node, rank) rides on
every line.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog


def configure_logging(stream: TextIO | None = None, fmt: str | None = None,
                      level: str | None = None, **context: Any) -> structlog.stdlib.BoundLogger:
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
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**{k: v for k, v in context.items() if v is not None})
    return structlog.get_logger()
