"""The timeline of one instance's history: rows for the CLI's text and the web UI's chart.

Each step attempt, sleep and wait becomes one row placed at the time it started (relative
to the first record) with its outcome and how long it took; everything else in the
history (start, pause, buffered events, the end) is a point in time. Rows still open at
the end of the history show what the instance is doing now. ``timeline_rows`` is the
model; ``render_timeline`` the CLI's text of it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from stepstream.engine.reads.views import HistoryEntry, mark_set_aside

# Open rows are keyed by (kind, key) so the record that ends a span finds its start.
_SpanKey = tuple[str, str]


@dataclass(slots=True)
class TimelineRow:
    """One row; times in ms since the first record. A span without ``took_ms`` is still
    open. ``retry_at_ms``: a failed attempt's next one is due then (its backoff);
    ``due_ms``: when a sleep ends or a wait times out."""

    at_ms: float
    kind: str
    name: str
    outcome: str
    detail: str = ""
    is_span: bool = False
    took_ms: float | None = None
    retry_at_ms: float | None = None
    due_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def took(self) -> str:
        if self.took_ms is not None:
            return _duration(self.took_ms)
        return "…" if self.is_span else ""


def render_timeline(history: Sequence[HistoryEntry]) -> str:
    """The history as aligned text lines, one row per step attempt, sleep, wait or event."""
    if not history:
        return "(no history)"
    return _format(timeline_rows(history))


def timeline_rows(history: Sequence[HistoryEntry]) -> list[TimelineRow]:
    """The rows of ``history``, in the order they started."""
    if not history:
        return []
    start = _ms(history[0].time)
    rows: list[TimelineRow] = []
    open_spans: dict[_SpanKey, TimelineRow] = {}

    def point(at: float, kind: str, name: str, outcome: str, detail: str = "") -> None:
        rows.append(TimelineRow(at - start, kind, name, outcome, detail))

    def begin(at: float, kind: str, name: str, outcome: str, detail: str = "") -> None:
        row = TimelineRow(at - start, kind, name, outcome, detail, is_span=True)
        rows.append(row)
        open_spans[(kind, name)] = row

    def end(at: float, kind: str, name: str, outcome: str, detail: str = "") -> TimelineRow:
        row = open_spans.pop((kind, name), None)
        if row is None:
            point(at, kind, name, outcome, detail)
            return rows[-1]
        row.outcome = outcome
        row.took_ms = at - start - row.at_ms
        row.detail = "  ".join(part for part in (row.detail, detail) if part)
        return row

    def abandon_open(at: float, why: str) -> None:
        # What the workflow started and never saw end (a cancel, a failure elsewhere, a
        # step nobody awaited) ends with it: it is not running any more.
        for kind, name in list(open_spans):
            end(at, kind, name, "abandoned", why)

    children: dict[str, str] = {}  # a child's key in the parent -> its instance id
    for entry in mark_set_aside(list(history)):
        if entry.set_aside:
            continue  # a reset took it back: the history keeps it, the timeline does not
        at = _ms(entry.time)
        a = entry.attributes
        key = str(a.get("key", ""))
        match entry.type:
            case "WorkflowStarted":
                point(at, "workflow", str(a.get("workflow", "")), "started", f"v{a.get('version')}")
            case "StepAttemptStarted":
                begin(
                    at,
                    "step",
                    key,
                    "running",
                    f"attempt {a.get('attempt')}/{a.get('max_attempts') or '∞'}",
                )
            case "StepSucceeded":
                end(at, "step", key, "ok")
            case "StepFailed":
                retry_at = a.get("next_attempt_at_ms")
                detail = _error(a)
                if isinstance(retry_at, int):
                    detail += f" (retry at +{_duration(retry_at - start)})"
                row = end(at, "step", key, "retry" if retry_at is not None else "failed", detail)
                if isinstance(retry_at, int):
                    row.retry_at_ms = retry_at - start
            case "SleepStarted":
                wake = a.get("wake_at_ms")
                until = f"until +{_duration(wake - start)}" if isinstance(wake, int) else ""
                begin(at, "sleep", key, "sleeping", until)
                if isinstance(wake, int):
                    rows[-1].due_ms = wake - start
            case "SleepElapsed":
                end(at, "sleep", key, "elapsed")
            case "WaitStarted":
                detail = f"event {a.get('event_name')}"
                timeout_at = a.get("timeout_at_ms")
                if isinstance(timeout_at, int):
                    detail += f", timeout at +{_duration(timeout_at - start)}"
                begin(at, "wait", key, "waiting", detail)
                if isinstance(timeout_at, int):
                    rows[-1].due_ms = timeout_at - start
            case "WaitSatisfied":
                event = str(a.get("event_name", ""))
                child = children.get(event.removeprefix("~child/"))
                payload = a.get("payload")
                if event.startswith("~child/") and child and isinstance(payload, dict):
                    end(at, "child", child, str(payload.get("status", "")), _child_error(payload))
                end(at, "wait", key, "received")
            case "MessageWaitStarted":
                names = ", ".join(str(n) for n in a.get("names") or ())
                detail = f"messages {names}" + (
                    f", up to {a['max']}" if a.get("max", 1) > 1 else ""
                )
                timeout_at = a.get("timeout_at_ms")
                if isinstance(timeout_at, int):
                    detail += f", timeout at +{_duration(timeout_at - start)}"
                begin(at, "wait", key, "waiting", detail)
            case "MessagesReceived":
                taken = len(a.get("ids") or ())
                end(at, "wait", key, "received", f"{taken} message{'s' if taken != 1 else ''}")
            case "MessageSent":
                point(at, "message", key, "sent", f"{a.get('name')} to {a.get('target')}")
            case "MessageCompleted":
                point(at, "message", str(a.get("message_id", "")), "answered")
            case "WaitTimedOut":
                end(at, "wait", key, "timed out")
            case "EventBuffered":
                point(at, "event", str(a.get("event_name", "")), "buffered")
            case "ValueRecorded":
                point(at, "value", key, str(a.get("kind", "")))
            case "AttributesSet":
                changed = a.get("attributes") or {}
                shown = ", ".join(f"{k}={_short(json.dumps(v), 40)}" for k, v in changed.items())
                point(at, "attributes", key, "set", shown)
            case "RaceDecided":
                losers = tuple(str(p) for p in a.get("losers") or ())
                for kind, name in [s for s in open_spans if s[1].startswith(losers)]:
                    end(at, kind, name, "abandoned", "lost the race")
                point(at, "race", key, "won", f"by {a.get('winner')}")
            case "CallRemoved":
                for kind, name in [s for s in open_spans if s[1] == key]:
                    end(at, kind, name, "abandoned", "removed from the code")
            case "LoopAdvanced":
                point(at, "loop", key, "next", f"iteration {a.get('iteration')}")
            case "ChildStarted":
                children[key] = str(a.get("child_id", ""))
                begin(at, "child", children[key], "running", f"{a.get('workflow')}")
            case "WorkflowPaused":
                point(at, "workflow", "", "paused")
            case "WorkflowResumed":
                point(at, "workflow", "", "resumed")
            case "WorkflowCompleted":
                abandon_open(at, "the workflow completed")
                point(at, "workflow", "", "completed", f"total {_duration(at - start)}")
            case "WorkflowFailed":
                abandon_open(at, "the workflow failed")
                point(at, "workflow", "", "failed", _error(a))
            case "WorkflowCancelled":
                abandon_open(at, "the workflow was cancelled")
                point(at, "workflow", "", "cancelled", _short(a.get("reason")) or "no reason")
            case "WorkflowReset":
                open_spans.clear()  # what was running is set aside with the rest
                first = int(a.get("from_seq", 0))
                aside = f"set aside seq {first}-{entry.seq - 1}" if entry.seq > first else ""
                point(
                    at,
                    "retry" if a.get("retry") else "reset",
                    str(a.get("to", "")),
                    "goes on",
                    "  ".join(part for part in (aside, _short(a.get("reason"))) if part),
                )
            case "WorkflowForked":
                point(at, "fork", str(a.get("to", "")), "goes on", f"from {a.get('source_id')}")
            case "WorkflowTerminated":
                abandon_open(at, "the workflow was terminated")
                point(at, "workflow", "", "terminated", _short(a.get("reason")) or "no reason")
            case "WorkflowTimeoutSet":
                due = a.get("timeout_at_ms")
                until = f"times out at +{_duration(due - start)}" if isinstance(due, int) else ""
                point(at, "workflow", "", "timeout set", until)
            case "WorkflowRestarted":
                ended = a.get("previous_status")
                point(at, "workflow", "", "restarted", f"run {a.get('run')}, after {ended}")
            case "CommandIgnored":
                point(
                    at,
                    "command",
                    str(a.get("command_type", "")),
                    "ignored",
                    _short(a.get("reason")),
                )
            case _:
                point(at, entry.type, key, "")
    return rows


def _format(rows: list[TimelineRow]) -> str:
    at = [f"+{_duration(r.at_ms)}" for r in rows]
    took = [r.took for r in rows]
    widths = [
        max(len(s) for s in at),
        max(len(r.kind) for r in rows),
        max(len(r.name) for r in rows),
        max(len(r.outcome) for r in rows),
        max(len(s) for s in took),
    ]
    lines = []
    for row, at_text, took_text in zip(rows, at, took, strict=True):
        cells = (
            at_text.rjust(widths[0]),
            row.kind.ljust(widths[1]),
            row.name.ljust(widths[2]),
            row.outcome.ljust(widths[3]),
            took_text.rjust(widths[4]),
            row.detail,
        )
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _ms(iso_time: str) -> float:
    return datetime.fromisoformat(iso_time).timestamp() * 1000


def _duration(ms: float) -> str:
    if ms < 1000:
        return f"{ms:.0f} ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.2f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _error(attributes: dict[str, Any]) -> str:
    return f"{attributes.get('error_type')}: {_short(attributes.get('error_message'))}"


def _short(value: Any, limit: int = 80) -> str:
    """One line of at most ``limit`` characters: a timeline row must stay a row."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _child_error(outcome: dict[str, Any]) -> str:
    error = str(outcome.get("error", ""))
    kind = str(outcome.get("error_type", ""))
    return _short(f"{kind}: {error}" if kind else error)
