"""The runtime a replay runs the code on: an ``InstanceRuntime`` with a fixed clock
that notes every ``ctx`` call, what the history holds at its key and what the code got
back (the trace of ``stepstream replay --trace``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from stepstream.engine.errors import HistoryDiverged
from stepstream.engine.replay.loop import ROOT_TASK, WorkflowLoop
from stepstream.engine.replay.runtime import InstanceRuntime
from stepstream.engine.replay.state import Entry, EntryState, InstanceState


class FixedClock:
    """Replay reads no wall clock: time stands at the last recorded record."""

    def __init__(self, ms: int) -> None:
        self._ms = ms

    def now_ms(self) -> int:
        return self._ms

    async def sleep(self, seconds: float) -> None:
        return None


@dataclass(slots=True)
class NotedCall:
    """One ``ctx`` call the code made, what the history holds at its key and what the
    code got back."""

    kind: str
    key: str
    entry_kind: str | None  # the recorded entry's kind at this key, if any
    seq: int | None
    final: bool  # the history holds the outcome: the code got it back at once
    saw: str = ""


class ReplayRuntime(InstanceRuntime):
    """Notes every ``ctx`` call and what it was given back. Overrides take any arguments
    and pass them on, so they keep working as the runtime's signatures grow."""

    def __init__(self, *args: Any, trace: bool, ended: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[NotedCall] = []
        self._tracing = trace
        self._value_counts: dict[str, int] = {}
        self._ended = ended  # the history has its end (the terminal record is not folded)

    def _history_goes_on(self) -> bool:
        # A finished history goes on past every point its code reaches, to its end: a
        # patch first met there was not in the code that made it.
        return self._ended or super()._history_goes_on()

    def _note(self, kind: str, key: str) -> NotedCall:
        entry = self.state.entries.get(key)
        call = NotedCall(
            kind,
            key,
            None if entry is None else entry.kind.value,
            None if entry is None else entry.seq,
            entry is not None and entry.state.final,
        )
        self.calls.append(call)
        return call

    def _watched(
        self, kind: str, make: Callable[..., asyncio.Future[Any]], args: Any, kwargs: Any
    ) -> asyncio.Future[Any]:
        call = self._note(kind, _key(args, kwargs))
        try:
            fut = make(*args, **kwargs)
        except HistoryDiverged:
            call.saw = f"diverged: the history has a {call.entry_kind} here"
            raise
        if self._tracing:
            if call.final:
                call.saw = _seen(fut)
            else:
                call.saw = _pending(None if call.seq is None else self.state.entries.get(call.key))
        return fut

    def step_future(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        return self._watched("step", super().step_future, args, kwargs)

    def sleep_future(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        return self._watched("sleep", super().sleep_future, args, kwargs)

    def wait_future(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        return self._watched("wait", super().wait_future, args, kwargs)

    def race_decided(self, *args: Any, **kwargs: Any) -> tuple[str, list[str]] | None:
        call = self._note("race", _key(args, kwargs))
        decided = super().race_decided(*args, **kwargs)
        if self._tracing:
            call.saw = "not decided yet" if decided is None else f"winner {decided[0]}"
        return decided

    def record_value(self, kind: str, produce: Callable[[], Any]) -> Any:
        produced = False

        def fresh() -> Any:
            nonlocal produced
            produced = True
            return produce()

        # Named as the runtime names values: the reading task's path and a count.
        path = WorkflowLoop.task_path()
        scope = f"{kind}#" if path == ROOT_TASK else f"{path}/{kind}#"
        self._value_counts[scope] = n = self._value_counts.get(scope, 0) + 1
        call = self._note("value", f"{scope}{n}")
        try:
            value = super().record_value(kind, fresh)
        except HistoryDiverged as exc:
            call.key = exc.key or kind
            call.entry_kind = _recorded_kind(self.state, exc.key)
            raise
        call.final = not produced
        if produced:
            call.seq = call.entry_kind = None
        if self._tracing:
            call.saw = _render(value) if not produced else f"new value {_render(value)}"
        return value


def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return str(args[0] if args else kwargs["key"])


def _recorded_kind(state: InstanceState, key: str) -> str | None:
    entry = state.entries.get(key)
    return None if entry is None else entry.kind.value


def _render(value: Any, limit: int = 300) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _seen(fut: asyncio.Future[Any]) -> str:
    if not fut.done():
        return "nothing yet"
    if fut.cancelled():
        return "cancelled"
    exc = fut.exception()
    if exc is not None:
        return f"raised {type(exc).__name__}: {_clip(str(exc))}"
    result = fut.result()
    return "elapsed" if result is None else _render(result)


def _pending(entry: Entry | None) -> str:
    if entry is None:
        return "not in the history: the instance goes on from here"
    if entry.state is EntryState.RUNNING:
        return f"attempt {entry.attempt} running"
    if entry.state is EntryState.BACKOFF:
        return f"attempt {entry.attempt} failed ({entry.error_type}); retry pending"
    if entry.state is EntryState.SLEEPING and entry.fire_at_ms is not None:
        return f"sleeping until {_iso(entry.fire_at_ms)}"
    if entry.state is EntryState.WAITING:
        return f"waiting for event {entry.event_name!r}"
    return entry.state.value


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def _clip(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
