"""The front end's log lines as text (default) or as JSON objects, one per line
(`exl3serve-openai --log-format json`), for log collectors that parse JSON: the access log's
lines (access.py) and every `logging` record of the front end, uvicorn's and the workers'
supervisor's included."""

from __future__ import annotations

import datetime
import enum
import json
import logging


class LogFormat(enum.Enum):
    TEXT = "text"
    JSON = "json"


LOG_FORMATS = tuple(f.value for f in LogFormat)


def json_time(seconds: float) -> str:
    """A time as the JSON lines give it: ISO 8601 in UTC, milliseconds."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


class JsonLogFormatter(logging.Formatter):
    """A logging record as one JSON object: time, level, logger, message (and the exception's
    traceback as `exception`, where the record has one)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": json_time(record.created), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str, fmt: LogFormat) -> None:
    """The root logger at `level` (debug, info, warning, error), its lines in `fmt`."""
    handler = logging.StreamHandler()
    if fmt is LogFormat.JSON:
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
