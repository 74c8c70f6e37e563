"""How the CLI's processes log: ``key=value`` text (the default) or one JSON object per
line (``--log-format json``, ``STEPSTREAM_LOG_FORMAT=json``) for a log pipeline.

The API stays the standard ``logging`` module: context goes in ``extra=`` fields, never
into the message. A line about an instance carries ``instance_id``, ``workflow``,
``partition``, ``trace_id`` and ``span_id`` (and ``step`` and ``attempt`` for a step
attempt): given with ``extra=``, or taken from what the processor or the step executor
is running when the line is logged (``consumers/log_context.py``), so the workflow
author's own lines inside a step carry them too. ``trace_id`` and ``span_id`` are those
of the run's span (``process <workflow>``) the tracer exports: the client's trace when
its start carried one, else the trace the run was given (``engine/wire/run_trace.py``).

JSON lines are made by python-json-logger (its orjson formatter): a standard
``logging.Formatter`` that turns every ``extra=`` field into a JSON field, so no list of
fields is kept here. The engine processes of ``stepstream dev --processes N`` add
``process`` (0 for the one that was started) to every line.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.orjson import OrjsonFormatter

from stepstream.consumers import log_context
from stepstream.consumers.log_context import TRACE_OF

FORMATS = ("text", "json")
# How this process was configured (level, format, process), for the processes it starts
# to log the same way (the span exporter); None until ``configure``.
_configured: tuple[str, str, int | None] | None = None

_STANDARD = frozenset((*RESERVED_ATTRS, "taskName"))


class ContextFilter(logging.Filter):
    """Adds the fields of the instance a line is about: those given with ``extra=``
    (``TRACE_OF`` made into ``trace_id`` and ``span_id``), else those of the instance
    being processed when it was logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = record.__dict__
        if "instance_id" not in fields:
            subject = log_context.current.get()
            if subject is not None:
                for key, value in subject.log_fields().items():
                    fields.setdefault(key, value)
        trace_of = fields.pop(TRACE_OF, None)
        if trace_of is not None:
            fields["trace_id"], fields["span_id"] = run_trace_ids(*trace_of)
        return True


@lru_cache(maxsize=4096)
def run_trace_ids(instance_id: str, run_start_ms: int, traceparent: str | None) -> tuple[str, str]:
    """The trace and span ids (hex) of an instance's run span, as the tracer makes them."""
    from stepstream.engine.wire.run_trace import run_span_id, trace_id_of_run
    from stepstream.ops.telemetry.span_attributes import client_context

    client = client_context(traceparent, None)
    trace_id = client.trace_id if client else trace_id_of_run(instance_id, run_start_ms)
    return format(trace_id, "032x"), format(run_span_id(instance_id, run_start_ms), "016x")


def _when(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a line was given beyond the standard ones."""
    return {
        key: value
        for key, value in record.__dict__.items()
        if key not in _STANDARD and not key.startswith("_") and value is not None
    }


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=... logger=... msg="..." key=value ...``; a traceback on the lines
    after."""

    def __init__(self, process: int | None = None) -> None:
        super().__init__()
        self._process = "" if process is None else f" process={process}"

    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"ts={_when(record)} level={record.levelname} logger={record.name}"
            f"{self._process} msg={json.dumps(record.getMessage(), ensure_ascii=False)}"
        )
        for key, value in extra_fields(record).items():
            line += f" {key}={_text(value)}"
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            line += "\n" + record.exc_text
        return line


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    if not text or any(c in text for c in ' "=\n\t'):
        return json.dumps(text, ensure_ascii=False)
    return text


class JsonFormatter(OrjsonFormatter):
    """One JSON object a line: ``ts``, ``level``, ``logger``, ``msg``, the line's fields,
    and ``exception`` (its traceback) when it has one."""

    def __init__(self, process: int | None = None) -> None:
        super().__init__(
            "%(levelname)s %(name)s %(message)s",
            rename_fields={
                "levelname": "level",
                "name": "logger",
                "message": "msg",
                "exc_info": "exception",
            },
            static_fields={} if process is None else {"process": process},
            reserved_attrs=sorted(_STANDARD),
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        log_data["ts"] = _when(record)
        super().add_fields(log_data, record, message_dict)
        for key in [k for k, v in log_data.items() if v is None]:
            del log_data[key]


def configure(level: str, log_format: str = "text", *, process: int | None = None) -> None:
    """``process``: which engine process of ``stepstream dev --processes N`` logs (a
    ``process`` field on every line), or None for the only one."""
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: use one of {', '.join(FORMATS)}")
    global _configured
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter if log_format == "json" else KeyValueFormatter
    handler.setFormatter(formatter(process))
    handler.addFilter(ContextFilter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    _configured = (level, log_format, process)


def configured() -> tuple[str, str, int | None] | None:
    """``configure``'s arguments in this process, if it was called: a child process
    passes them to ``configure`` to log as its parent does."""
    return _configured
