"""Server logs as text or as one JSON object per line (for log shippers)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message"}``; uvicorn's access lines also get client, method,
    path, status as fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, path, _, status = record.args
            entry.update(client=client, method=method, path=path, status=status)
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def uvicorn_log_config(log_format: str) -> dict[str, Any] | None:
    """uvicorn's ``log_config`` for ``log_format`` (None: uvicorn's own text format)."""
    if log_format == "text":
        return None
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "featurestore.logs.JsonFormatter"}},
        "handlers": {"default": handler},
        "loggers": {
            name: {"handlers": ["default"], "propagate": False}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "featurestore")
        },
    }
