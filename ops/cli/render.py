"""What the commands print: JSON for ``--json``, and for people key/value blocks, the
instance table, one line per history record (``history --follow``) and the timeline
(``ops.timeline``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from stepstream.engine.reads.views import HistoryEntry, InstanceStatus, Wait
from stepstream.ops.tools.timeline import render_timeline

__all__ = [
    "compact",
    "describe_status",
    "instance_table",
    "key_values",
    "output",
    "print_json",
    "record_line",
    "render_timeline",
]


def output(args: argparse.Namespace, as_json: Any, human: str) -> None:
    """``as_json`` with ``--json``, else ``human``."""
    if args.json:
        print_json(as_json)
    else:
        print(human)


def print_json(value: Any, *, one_line: bool = False) -> None:
    """``value`` as JSON: indented, or on one line (a stream of records, JSON Lines)."""
    if one_line:
        print(json.dumps(value, ensure_ascii=False, separators=(",", ":")), flush=True)
    else:
        print(json.dumps(value, indent=2, ensure_ascii=False))


def compact(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _shown(value: Any) -> str:
    # An attribute as --where takes it: text quoted, so "42" and 42 read apart.
    return json.dumps(value, ensure_ascii=False)


def key_values(pairs: Sequence[tuple[str, str]]) -> str:
    width = max(len(key) for key, _ in pairs) + 1
    lines = []
    for key, value in pairs:
        label = f"{key}:"
        for line in value.splitlines() or [""]:
            lines.append(f"{label:<{width}} {line}".rstrip())
            label = ""
    return "\n".join(lines)


def describe_status(status: InstanceStatus) -> str:
    pairs = [
        ("instance", status.instance_id),
        ("workflow", status.workflow),
        ("version", status.version),
        ("status", status.status),
        ("created", status.created_at),
        ("updated", status.updated_at),
        ("waits", "\n".join(_describe_wait(w) for w in status.waits) or "none"),
    ]
    if status.buffered_events:
        pairs.append(("buffered", f"{status.buffered_events} event(s) the code has not taken yet"))
    if status.error:
        pairs.append(("error", status.error))
    if status.origin:
        pairs.append(("origin", status.origin))
    if status.run > 1:
        pairs.append(("run", f"{status.run} (restarted {status.run - 1} time(s))"))
    if status.attributes:
        shown = (f"{key}={_shown(value)}" for key, value in sorted(status.attributes.items()))
        pairs.append(("attributes", "\n".join(shown)))
    return key_values(pairs)


def _describe_wait(wait: Wait) -> str:
    details = [wait.state]
    if wait.queue:
        details.append(f"for a slot of {wait.queue}")
        if wait.position is not None:
            details.append(f"position {wait.position} of {wait.waiting} waiting")
    if wait.event:
        details.append(f"event {wait.event}")
    if wait.attempt:
        details.append(f"attempt {wait.attempt}")
    if wait.until:
        details.append(f"until {wait.until}")
    return f"{wait.kind} {wait.key} ({', '.join(details)})"


def instance_table(instances: Sequence[InstanceStatus]) -> str:
    if not instances:
        return "no instances"
    header = ("INSTANCE", "WORKFLOW", "VERSION", "STATUS", "CREATED", "UPDATED", "ATTRIBUTES")
    rows = [header] + [
        (
            i.instance_id,
            i.workflow,
            i.version,
            i.status,
            i.created_at,
            i.updated_at,
            " ".join(f"{k}={_shown(v)}" for k, v in sorted(i.attributes.items())),
        )
        for i in instances
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


# The attributes a record line shows after its key, in this order, when present.
_RECORD_DETAILS = (
    "workflow",
    "version",
    "attempt",
    "event_name",
    "child_id",
    "error_type",
    "error_message",
    "reason",
    "to",  # a reset's or a fork's key, and where what it set aside begins
    "from_seq",
    "source_id",
)


def record_line(entry: HistoryEntry) -> str:
    """One history record as one line: sequence number, time, type, key and the
    attributes that say most about it (``history --follow`` prints these as they come)."""
    attributes = entry.attributes
    parts = [f"{entry.seq:>5}", _clock(entry.time), f"{entry.type:<20}"]
    key = attributes.get("key")
    if key:
        parts.append(str(key))
    for name in _RECORD_DETAILS:
        value = attributes.get(name)
        if value not in (None, ""):
            parts.append(f"{name}={_short(value)}")
    if entry.set_aside:
        parts.append("(set aside by a reset)")
    return "  ".join(parts).rstrip()


def _clock(iso_time: str) -> str:
    """The time of day with milliseconds (the date is in ``--json``)."""
    try:
        moment = datetime.fromisoformat(iso_time)
    except ValueError:
        return iso_time
    return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 1000:03d}"


def _short(value: Any, limit: int = 60) -> str:
    text = " ".join(compact(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
