"""How the CLI's processes log: ``key=value`` text (the default) or one JSON object per
line (``--log-format json``, ``STEPSTREAM_LOG_FORMAT=json``) for a log pipeline.

The engine's log lines name what they concern as ``key=value`` pairs in the message
(``instance=... step=... attempt=... partition=...``). The JSON format lifts those into
fields of their own (``instance_id``, ``workflow``, ``step``, ``attempt``, ``partition``,
``trace_id``), so an operator can filter on them; fields passed with ``extra=`` are
kept as they are. The engine processes of ``stepstream dev --processes N`` add
``process`` (0 for the one that was started) to every line.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any

FORMATS = ("text", "json")
# How this process was configured (level, format, process), for the processes it starts
# to log the same way (the span exporter); None until ``configure``.
_configured: tuple[str, str, int | None] | None = None

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
    def __init__(self, process: int | None = None) -> None:
        super().__init__()
        self._process = "" if process is None else f" process={process}"

    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"ts={_when(record)} level={record.levelname} logger={record.name}"
            f"{self._process} msg={json.dumps(record.getMessage(), ensure_ascii=False)}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def __init__(self, process: int | None = None) -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        out: dict[str, Any] = {
            "ts": _when(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": message,
        }
        if self._process is not None:
            out["process"] = self._process
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


def configure(level: str, log_format: str = "text", *, process: int | None = None) -> None:
    """``process``: which engine process of ``stepstream dev --processes N`` logs (a
    ``process`` field on every line), or None for the only one."""
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: use one of {', '.join(FORMATS)}")
    global _configured
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter if log_format == "json" else KeyValueFormatter
    handler.setFormatter(formatter(process))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    _configured = (level, log_format, process)


def configured() -> tuple[str, str, int | None] | None:
    """``configure``'s arguments in this process, if it was called: a child process
    passes them to ``configure`` to log as its parent does."""
    return _configured
