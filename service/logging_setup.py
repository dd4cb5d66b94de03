"""Log formats for `dpledger serve`: one JSON object a line (for a log shipper) or plain text.

Structured fields travel on a record as `extra={"fields": {...}}`; both formatters print them, so
the code that logs never builds strings by hand. Nothing here reads headers: callers pass only the
fields they mean to log, which is how API keys stay out of the logs.
"""

from __future__ import annotations

import json
import logging
import math
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["json", "text"]
FORMATS: tuple[LogFormat, ...] = ("json", "text")


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


def _json_safe(value: Any) -> Any:
    # ε may be +inf (beyond the RDP orders' range); JSON has no inf, and a shipper would reject the line.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        payload.update({k: _json_safe(v) for k, v in fields_of(record).items()})
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={v}" for k, v in fields_of(record).items() if v is not None)
        return f"{line} {extra}" if extra else line


def logging_config(log_format: LogFormat, *, level: str = "INFO") -> dict[str, Any]:
    """A `logging.config.dictConfig` dict, also handed to uvicorn as `log_config` so that its own
    lines (startup, errors) come out in the same format, in every worker process it spawns."""
    formatter = JsonFormatter if log_format == "json" else TextFormatter
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"dpledger": {"()": f"{formatter.__module__}.{formatter.__qualname__}"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "dpledger", "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["stderr"], "level": "WARNING"},
        "loggers": {
            # uvicorn's access log is off (serve passes access_log=False): dpledger.access replaces
            # it with the route template, the caller's role and the charge's outcome.
            "uvicorn": {"level": level, "handlers": [], "propagate": True},
            "uvicorn.error": {"level": level, "handlers": [], "propagate": True},
            "uvicorn.access": {"level": level, "handlers": [], "propagate": True},
            "dpledger": {"level": level, "handlers": [], "propagate": True},
        },
    }
