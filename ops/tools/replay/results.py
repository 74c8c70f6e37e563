"""What a replay finds: each history's ``ReplayResult`` (with the trace of the code's
``ctx`` calls), the ``ReplaySummary`` of many, their text and JSON, and
``ReplayDiverged``, the error ``stepstream.testing.replay`` raises."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stepstream.engine.errors import HistoryDiverged


class ReplayDiverged(HistoryDiverged):
    """``stepstream.testing.replay`` found that the code no longer matches the history:
    ``key`` is where, ``recorded`` what the history has there and ``reached`` what the
    code did instead."""

    def __init__(
        self, message: str, *, key: str, recorded: str, reached: str, instance_id: str
    ) -> None:
        super().__init__(message, key=key)
        self.recorded = recorded
        self.reached = reached
        self.instance_id = instance_id


@dataclass(frozen=True, slots=True)
class TraceStep:
    """One ``ctx`` call the code made on replay and what it got back. ``seq`` is the
    record that first made the key (None: the history does not have it yet)."""

    kind: str
    key: str
    seq: int | None
    saw: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "seq": self.seq, "saw": self.saw}


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """``outcome``: "ok"; "diverged" (``key``, ``recorded``, ``reached``); "missing" (no
    code for the instance's workflow version); "error" (replay itself raised); or
    "skipped" (the history does not begin at its start, as read from an offset)."""

    instance_id: str
    workflow: str
    version: str
    outcome: str
    records: int
    key: str = ""
    recorded: str = ""
    reached: str = ""
    message: str = ""
    trace: tuple[TraceStep, ...] = ()
    result: Any = None  # what the code returned, when the history ends completed

    @property
    def ok(self) -> bool:
        return self.outcome in ("ok", "skipped")

    def line(self) -> str:
        head = f"{_token(self.instance_id)} {self.outcome}"
        if self.outcome == "diverged":
            return (
                f"{head} key={_token(self.key)} recorded={_token(self.recorded)} "
                f"reached={_token(self.reached)}"
            )
        if self.outcome == "ok":
            return head
        return f"{head}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "instance_id": self.instance_id,
            "workflow": self.workflow,
            "version": self.version,
            "outcome": self.outcome,
            "records": self.records,
        }
        if self.outcome == "diverged":
            out.update(key=self.key, recorded=self.recorded, reached=self.reached)
        if self.message:
            out["message"] = self.message
        if self.trace:
            out["trace"] = [step.to_json() for step in self.trace]
        return out


def _token(text: str) -> str:
    """``text`` as one word of a line: as it is when it is plain, else JSON-quoted."""
    if text and not any(c.isspace() or c in "=\"'" for c in text):
        return text
    return json.dumps(text, ensure_ascii=False)


@dataclass(slots=True)
class ReplaySummary:
    counts: dict[str, int] = field(default_factory=dict)
    replayed: int = 0
    seconds: float = 0.0

    def add(self, result: ReplayResult) -> None:
        self.replayed += 1
        self.counts[result.outcome] = self.counts.get(result.outcome, 0) + 1

    @property
    def failed(self) -> int:
        return sum(n for outcome, n in self.counts.items() if outcome not in ("ok", "skipped"))

    def describe(self) -> str:
        order = ("ok", "diverged", "missing", "error", "skipped")
        return ", ".join(f"{self.counts[o]} {o}" for o in order if self.counts.get(o))

    def to_json(self) -> dict[str, Any]:
        return {
            "replayed": self.replayed,
            "seconds": round(self.seconds, 3),
            **{o: self.counts.get(o, 0) for o in ("ok", "diverged", "missing", "error", "skipped")},
        }


def render_trace(result: ReplayResult) -> str:
    if not result.trace:
        return "  (the code made no ctx calls)"
    lines = []
    for step in result.trace:
        seq = f"seq {step.seq:>4}" if step.seq is not None else "   new  "
        lines.append(f"  {seq}  {step.kind:<5} {step.key}  ->  {step.saw}")
    return "\n".join(lines)
