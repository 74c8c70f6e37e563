"""How the CLI's processes log: ``key=value`` text (the default) or one JSON object per
line (``--log-format json``, ``STEPSTREAM_LOG_FORMAT=json``) for a log pipeline.

The engine's log lines name what they concern as ``key=value`` pairs in the message
(``instance=... step=... attempt=... partition=...``). The JSON format lifts those into
fields of their own (``instance_id``, ``workflow``, ``step``, ``attempt``, ``partition``,
``trace_id``), so an operator can filter on them; fields passed with ``extra=`` are
kept as they are.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any

FORMATS = ("text", "json")

# Message keys -> JSON field names.
_FIELDS = {
    "instance": "instance_id",
    "workflow": "workflow",
    "step": "step",
    "attempt": "attempt",
    "partition": "partition",
    "trace": "trace_id",
    "reason": "reason",
}
_PAIR = re.compile(r"\b(" + "|".join(_FIELDS) + r")=(\"[^\"]*\"|'[^']*'|[^\s,;:]+)")
_EXTRA = ("instance_id", "workflow", "step", "attempt", "partition", "trace_id")


def _when(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"ts={_when(record)} level={record.levelname} logger={record.name} "
            f"msg={json.dumps(record.getMessage(), ensure_ascii=False)}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out: dict[str, Any] = {
            "ts": _when(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": message,
        }
        for key, value in _PAIR.findall(message):
            field = _FIELDS[key]
            if field not in out and value != "-":
                out[field] = _typed(field, value.strip("\"'"))
        for field in _EXTRA:
            value = record.__dict__.get(field)
            if value is not None:
                out[field] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def _typed(field: str, value: str) -> Any:
    if field in ("attempt", "partition") and value.isdigit():
        return int(value)
    if field == "trace_id" and value.count("-") == 3:
        return value.split("-")[1]  # a traceparent: its trace id
    return value


def configure(level: str, log_format: str = "text") -> None:
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: use one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else KeyValueFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
