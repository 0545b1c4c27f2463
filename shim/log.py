"""Structured logs: one JSON object per line on stderr."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def setup(level: str) -> None:
    if level not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(_LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter())
    logging.getLogger().handlers[:] = [handler]
    set_level(level)


def set_level(level: str) -> None:
    """Log at ``level`` from now on (at start, and when the config file changes it)."""
    if level not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(_LEVELS)}")
    logging.getLogger().setLevel(_LEVELS[level])
    # grpclib and asyncio speak at debug level about every stream; keep them to warnings.
    for noisy in ("grpclib", "hpack", "h2", "asyncio"):
        logging.getLogger(noisy).setLevel(max(_LEVELS[level], logging.WARNING))


LEVELS = tuple(_LEVELS)
