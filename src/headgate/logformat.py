"""How the ``headgate`` command writes its log lines: text for people, JSON for collectors.

``headgate serve --log-format json`` writes one JSON object per line, so that
a container runtime, journald or a log shipper can index the fields without
parsing prose. Every object has ``time`` (UTC, ISO 8601 with milliseconds),
``level``, ``logger`` and ``message``; the fields a caller passed with
``extra=`` follow, and ``exception`` holds a traceback where there is one. A
message with a newline in it stays one line: JSON escapes it.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

__all__ = ["LOG_FORMATS", "TEXT_FORMAT", "JsonLineFormatter", "use_log_format"]

#: The choices of ``--log-format``.
LOG_FORMATS = ("text", "json")

#: The text format: time, level, logger, message.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: The attributes every LogRecord has; any other attribute came from ``extra=``.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        entry: dict[str, Any] = {
            "time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and not key.startswith("_"):
                entry.setdefault(key, value)  # the four fields above are not overridden
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # default=str: an extra field that JSON cannot hold is logged as its str().
        return json.dumps(entry, default=str, ensure_ascii=False)


def use_log_format(name: str, logger: logging.Logger | None = None) -> None:
    """Make every handler of ``logger`` (the root logger by default) write ``name``'s format."""
    if name not in LOG_FORMATS:
        raise ValueError(f"log format {name!r}: expected one of {', '.join(LOG_FORMATS)}")
    formatter = JsonLineFormatter() if name == "json" else logging.Formatter(TEXT_FORMAT)
    for handler in (logger or logging.getLogger()).handlers:
        handler.setFormatter(formatter)
