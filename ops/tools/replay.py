"""Replay: today's workflow code against recorded histories, with no side effects.

Each history is folded into an ``InstanceState`` (``InstanceState.apply``, as a restore
does) and an ``InstanceRuntime`` with a fixed clock recovers it: the code runs from its
start, every ``ctx`` call gets what the history recorded, and the runtime checks that the
code reaches every recorded key with the same kind (``HistoryDiverged`` otherwise). What
the runtime decides past the recorded end (records, timers, step launches) is where the
instance would go on; it is dropped: no step body runs and nothing is written.

A finished history replays without its last record, and the code must end the same way
(a completed history must complete again, a failed one fail), without new steps first.

Histories come from an embedded data directory (opened read-only), from a client
(``Client.list`` + ``Client.history``), from a Kafka history topic (folded by the reader
rules of ``schemas/README.md``) or from export files (``ops.tools.history_export``).
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

from stepstream.engine.api.workflow import Registry, WorkflowDefinition
from stepstream.engine.errors import (
    HistoryDiverged,
    StepstreamError,
    UndecodableRecord,
    UnknownWorkflow,
)
from stepstream.engine.replay.effects import Output
from stepstream.engine.replay.loop import ROOT_TASK, WorkflowLoop
from stepstream.engine.replay.runtime import InstanceRuntime
from stepstream.engine.replay.state import Entry, EntryState, InstanceState
from stepstream.engine.wire.codec import JsonCodec, PayloadCodec, decode_safely
from stepstream.engine.wire.records import (
    HistoryRecord,
    InstanceForgotten,
    PartitionFenced,
    StepAttemptStarted,
    ValueRecorded,
    WaitStarted,
    WorkflowCancelled,
    WorkflowCompleted,
    WorkflowFailed,
    WorkflowPaused,
    WorkflowResumed,
    WorkflowStarted,
)
from stepstream.engine.wire.records import SleepStarted as SleepStartedRecord
from stepstream.engine.wire.serde import RecordSerde, default_serde
from stepstream.ops import event_loop

DIVERGED_TYPE = "HistoryDiverged"
PROGRESS_EVERY = 1000
_TERMINAL = (WorkflowCompleted, WorkflowFailed, WorkflowCancelled)
# Records that open a new replay key: the code made a call the history does not have.
_NEW_CALLS: dict[type[HistoryRecord], str] = {
    StepAttemptStarted: "step",
    SleepStartedRecord: "sleep",
    WaitStarted: "wait",
    ValueRecorded: "value",
}
_QUOTED = re.compile(r"history has \w+ ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")


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
class History:
    """One instance's recorded story, in sequence order."""

    instance_id: str
    records: list[HistoryRecord]

    @property
    def started(self) -> WorkflowStarted | None:
        first = self.records[0] if self.records else None
        return first if isinstance(first, WorkflowStarted) else None


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


# ---- replaying one history -----------------------------------------------------------------


class _FixedClock:
    """Replay reads no wall clock: time stands at the last recorded record."""

    def __init__(self, ms: int) -> None:
        self._ms = ms

    def now_ms(self) -> int:
        return self._ms

    async def sleep(self, seconds: float) -> None:
        return None


@dataclass(slots=True)
class _Call:
    kind: str
    key: str
    entry_kind: str | None  # the recorded entry's kind at this key, if any
    seq: int | None
    final: bool  # the history holds the outcome: the code got it back at once
    saw: str = ""


class _ReplayRuntime(InstanceRuntime):
    """Notes every ``ctx`` call and what it was given back. Overrides take any arguments
    and pass them on, so they keep working as the runtime's signatures grow."""

    def __init__(self, *args: Any, trace: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[_Call] = []
        self._tracing = trace
        self._value_counts: dict[str, int] = {}

    def _note(self, kind: str, key: str) -> _Call:
        entry = self.state.entries.get(key)
        call = _Call(
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


def replay_history(
    history: History,
    registry: Registry,
    *,
    codec: PayloadCodec | None = None,
    until_seq: int | None = None,
    trace: bool = False,
) -> ReplayResult:
    """Replay the current code of ``history``'s workflow version against it."""
    records = history.records
    if until_seq is not None:
        records = [r for r in records if r.seq <= until_seq]
    started = history.started

    def made(outcome: str, **details: Any) -> ReplayResult:
        return ReplayResult(
            instance_id=history.instance_id,
            workflow=started.workflow if started is not None else "",
            version=started.version if started is not None else "",
            outcome=outcome,
            records=len(records),
            **details,
        )

    if started is None or started.seq != 1:
        first = records[0].seq if records else 0
        return made(
            "skipped",
            message=f"the history read starts at seq {first}, not at the WorkflowStarted "
            "that begins the instance (read from an earlier offset to replay it)",
        )
    # Gaps are expected: a loop's pruned iterations leave the stored history, and replay
    # starts the loop at its last recorded iteration anyway.
    try:
        definition = registry.resolve(started.workflow, started.version)
    except UnknownWorkflow as exc:
        return made("missing", message=str(exc))
    ended: list[str] = []  # how the code ended, if it did

    async def noted(ctx: Any, arg: Any) -> Any:
        try:
            value = await definition.fn(ctx, arg)
        except Exception as exc:
            ended.append(f"end:raised:{type(exc).__name__}")
            raise
        ended.append("end:returned")
        return value

    state = InstanceState(history.instance_id)
    end: HistoryRecord | None = None
    try:
        for record in records:
            if isinstance(record, _TERMINAL):
                end = record
            elif not isinstance(record, WorkflowPaused | WorkflowResumed):
                # Pauses only stop the code between commands; replay runs it regardless.
                state.apply(record)
    except Exception as exc:
        return made("error", message=f"folding the history raised {type(exc).__name__}: {exc}")
    recorded = {key: (e.kind.value, e.seq) for key, e in state.entries.items()}
    runtime = _ReplayRuntime(
        state,
        WorkflowDefinition(definition.name, definition.version, noted),
        codec=codec or JsonCodec(),
        clock=_FixedClock(records[-1].time_ms),
        epoch=max(r.epoch for r in records) + 1,
        trace=trace,
    )
    out = Output()
    try:
        runtime.recover(out)
    except HistoryDiverged:
        pass  # read below from runtime.diverged
    except Exception as exc:
        return made("error", message=f"replay raised {type(exc).__name__}: {exc}")
    finally:
        runtime.close()
    steps = tuple(TraceStep(c.kind, c.key, c.seq, c.saw) for c in runtime.calls) if trace else ()
    diverged = _divergence(runtime, out, recorded, ended)
    if diverged is None:
        diverged = _ending_differs(end, out, runtime.calls)
    if diverged is not None:
        key, was, got, message = diverged
        return made(
            "diverged",
            key=key,
            recorded=was,
            reached=got,
            message=message,
            trace=steps,
        )
    result = None
    completed = next((r for r in out.history if isinstance(r, WorkflowCompleted)), None)
    if completed is not None:
        try:
            result = decode_safely(runtime.codec, completed.result)
        except StepstreamError:
            result = None
    return made("ok", trace=steps, result=result)


def _divergence(
    runtime: _ReplayRuntime, out: Output, recorded: dict[str, tuple[str, int]], ended: list[str]
) -> tuple[str, str, str, str] | None:
    """(key, recorded, reached, message) where the runtime found the code diverging."""
    message = _diverged_message(runtime, out)
    if message is None:
        return None
    key = _diverged_key(runtime, message)
    was = recorded.get(key, ("?", 0))[0]
    mismatch = next((c for c in runtime.calls if c.key == key and c.kind != was), None)
    if mismatch is not None:
        return key, was, f"{mismatch.kind}:{key}", message
    return key, was, _reached_instead(runtime.calls, recorded, ended), message


def _diverged_message(runtime: _ReplayRuntime, out: Output) -> str | None:
    """The runtime's verdict, however it gives it: the HistoryDiverged it keeps, a
    WorkflowFailed(HistoryDiverged) it decided, or the instance parked with a reason."""
    found = _diverged_error(runtime)
    if found is not None:
        return str(found)
    for record in out.history:
        if isinstance(record, WorkflowFailed) and record.error_type == DIVERGED_TYPE:
            return record.error_message
    if runtime.state.parked and not runtime.state.status.finished:
        return runtime.state.parked
    return None


def _diverged_error(runtime: _ReplayRuntime) -> HistoryDiverged | None:
    found = getattr(runtime, "diverged", None) or getattr(runtime, "_diverged", None)
    return found if isinstance(found, HistoryDiverged) else None


def _diverged_key(runtime: _ReplayRuntime, message: str) -> str:
    found = _diverged_error(runtime)
    if found is not None and found.key:
        return found.key
    match = _QUOTED.search(message)
    if match is not None:
        try:
            return str(ast.literal_eval(match.group(1)))
        except (ValueError, SyntaxError):
            pass
    return ""


def _reached_instead(
    calls: Sequence[_Call], recorded: dict[str, tuple[str, int]], ended: list[str]
) -> str:
    """What the code did where the history has the missed key: its first call the history
    does not have, or how it ended, or that it only waits on what is recorded."""
    for call in calls:
        if call.key not in recorded and call.entry_kind is None and not call.final:
            return f"{call.kind}:{call.key}"
    if ended:
        return ended[0]
    return "nothing (the code waits on recorded calls only)"


def _ending_differs(
    end: HistoryRecord | None, out: Output, calls: Sequence[_Call]
) -> tuple[str, str, str, str] | None:
    """A finished history whose code now ends otherwise, or makes new calls first."""
    if not isinstance(end, WorkflowCompleted | WorkflowFailed):
        return None  # cancelled (or not finished): where the code stands is enough
    if isinstance(end, WorkflowFailed) and end.error_type == DIVERGED_TYPE:
        return None
    was = "completed" if isinstance(end, WorkflowCompleted) else "failed"
    new = next((r for r in out.history if type(r) in _NEW_CALLS), None)
    finished = next((r for r in out.history if isinstance(r, _TERMINAL)), None)
    if new is not None:
        key = str(getattr(new, "key", ""))
        got = f"{_NEW_CALLS[type(new)]}:{key}"
        if isinstance(new, ValueRecorded):
            key = new.key
            got = f"value:{new.kind}"
        return (
            key,
            was,
            got,
            f"the history ends {was} at seq {end.seq}, but the code now makes a new call "
            f"({got}) before it ends",
        )
    if finished is None:
        return (
            "(end)",
            was,
            "waiting",
            f"the history ends {was} at seq {end.seq}, but the code now waits instead",
        )
    if isinstance(end, WorkflowCompleted) and not isinstance(finished, WorkflowCompleted):
        got = _ended(finished)
    elif isinstance(end, WorkflowFailed) and not isinstance(finished, WorkflowFailed):
        got = _ended(finished)
    else:
        return None
    return ("(end)", was, got, f"the history ends {was} at seq {end.seq}, the code now {got}")


def _ended(record: HistoryRecord) -> str:
    if isinstance(record, WorkflowFailed):
        return f"failed:{record.error_type}"
    return "completed" if isinstance(record, WorkflowCompleted) else record.type


def replay_all(
    histories: Iterable[History],
    registry: Registry,
    *,
    codec: PayloadCodec | None = None,
    workflow: str | None = None,
    until_seq: int | None = None,
    trace: bool = False,
    on_result: Callable[[ReplayResult], None] | None = None,
    progress: TextIO | None = None,
    total: int | None = None,
) -> ReplaySummary:
    """Replay every history (of ``workflow`` only, if given); ``on_result`` sees each
    result as it comes, ``progress`` a line every ``PROGRESS_EVERY`` histories."""
    summary = ReplaySummary()
    began = time.monotonic()
    for history in histories:
        started = history.started
        if workflow is not None and (started is None or started.workflow != workflow):
            continue
        result = replay_history(history, registry, codec=codec, until_seq=until_seq, trace=trace)
        summary.add(result)
        if on_result is not None:
            on_result(result)
        if progress is not None and summary.replayed % PROGRESS_EVERY == 0:
            of = f" of {total}" if total is not None else ""
            print(
                f"replayed {summary.replayed}{of} histories in "
                f"{time.monotonic() - began:.1f} s ({summary.describe()})",
                file=progress,
                flush=True,
            )
    summary.seconds = time.monotonic() - began
    return summary


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


# ---- where histories come from --------------------------------------------------------------


def group_records(records: Iterable[HistoryRecord]) -> list[History]:
    """Records of any instances, each instance's in sequence order."""
    stories: dict[str, list[HistoryRecord]] = {}
    for record in records:
        stories.setdefault(record.instance_id, []).append(record)
    return [
        History(instance_id, sorted(story, key=lambda r: r.seq))
        for instance_id, story in stories.items()
    ]


def fold_history_log(
    entries: Iterable[tuple[int, bytes]], serde: RecordSerde | None = None
) -> tuple[list[History], int]:
    """Fold raw history-topic records ((partition, value) in offset order per partition)
    by the reader rules of ``schemas/README.md``: records of an epoch below the newest
    fence are skipped, so are re-deliveries (seq not above the last one of the instance);
    an ``InstanceForgotten`` drops the instance. Returns the stories and how many records
    were skipped as unreadable."""
    serde = serde or default_serde()
    fences: dict[int, int] = {}
    stories: dict[str, list[HistoryRecord]] = {}
    unreadable = 0
    for partition, value in entries:
        try:
            record = serde.decode(value)
        except UndecodableRecord:
            unreadable += 1
            continue
        if isinstance(record, PartitionFenced):
            fences[partition] = max(fences.get(partition, 0), record.epoch)
            continue
        if not isinstance(record, HistoryRecord) or record.epoch < fences.get(partition, 0):
            continue
        story = stories.setdefault(record.instance_id, [])
        if story and record.seq <= story[-1].seq:
            continue
        if isinstance(record, InstanceForgotten):
            del stories[record.instance_id]
            continue
        story.append(record)
    return [History(i, story) for i, story in stories.items() if story], unreadable


def read_data_dir(path: str, *, instance_id: str | None = None) -> Iterator[History]:
    """Histories in an embedded data directory, read from a read-only RocksDB: the
    writer's lock is not taken (a running engine may hold it) and nothing is written."""
    from stepstream.consumers.embedded.readonly import ReadOnlyData

    serde = default_serde()
    with ReadOnlyData(path) as data:
        for instance, values in data.histories(instance_id):
            records = []
            for value in values:
                record = serde.decode(value)
                if isinstance(record, HistoryRecord):
                    records.append(record)
            yield History(instance, records)


def read_kafka(settings: Any, *, from_offset: int = 0) -> tuple[list[History], int]:
    """Every partition of ``<prefix>.history`` from ``from_offset`` (or its first offset)
    to its end, folded by the reader rules. Returns the histories and how many records
    could not be read."""
    from stepstream.consumers.kafka.admin import existing_partitions
    from stepstream.consumers.kafka.restore import HistoryReader
    from stepstream.engine.wire.topics import HISTORY, TopicNames

    topic = TopicNames(settings.prefix).name(HISTORY)
    partitions = existing_partitions(settings).get(topic)
    if partitions is None:
        raise StepstreamError(
            f"topic {topic} does not exist on {settings.bootstrap}; check --bootstrap and --prefix"
        )
    raw: list[tuple[int, bytes]] = []
    reader = HistoryReader(settings)
    try:
        for partition in range(partitions):
            low, end = reader.end(partition)
            start = max(low, from_offset)
            if start >= end:
                continue
            reader.read(partition, start, None, _collect(raw, partition))
    finally:
        reader.close()
    return fold_history_log(raw)


def _collect(into: list[tuple[int, bytes]], partition: int) -> Callable[[int, bytes, Any], None]:
    def on_record(_offset: int, value: bytes, _headers: Any) -> None:
        into.append((partition, value))

    return on_record


async def read_client(
    client: Any,
    *,
    instance_id: str | None = None,
    workflow: str | None = None,
    concurrency: int = 16,
) -> list[History]:
    """Histories through a client: ``Client.list`` and ``Client.history``, rebuilt into
    records (``ops.tools.history_export.records_from_entries``)."""
    from stepstream.ops.tools.history_export import records_from_entries

    if instance_id is not None:
        ids = [instance_id]
    else:
        ids = [
            s.instance_id for s in await client.list() if workflow is None or s.workflow == workflow
        ]
    limit = asyncio.Semaphore(concurrency)

    async def one(instance: str) -> History:
        async with limit:
            entries = await client.history(instance)
        return History(instance, records_from_entries(instance, entries))

    return list(await asyncio.gather(*(one(i) for i in ids)))


def read_files(paths: Sequence[str | os.PathLike[str]]) -> list[History]:
    from stepstream.ops.tools.history_export import read_export

    out = []
    for path in paths:
        exported = read_export(path)
        out.append(History(exported.instance_id, exported.records))
    return out


def render_trace(result: ReplayResult) -> str:
    if not result.trace:
        return "  (the code made no ctx calls)"
    lines = []
    for step in result.trace:
        seq = f"seq {step.seq:>4}" if step.seq is not None else "   new  "
        lines.append(f"  {seq}  {step.kind:<5} {step.key}  ->  {step.saw}")
    return "\n".join(lines)


# ---- the command line (``stepstream replay``) -------------------------------------------------


def main(args: Any) -> int:
    """``stepstream replay``; the arguments were checked by ``ops.cli``. Returns the exit
    status: 0 when every history replays, 1 when any diverges (or has no code, or fails)."""
    registry = Registry()
    registry.add_modules(args.workflows)
    histories, total = _histories(args)
    single = args.instance is not None or (args.file is not None and len(args.file) == 1)
    results: list[dict[str, Any]] = []
    found = False

    def show(result: ReplayResult) -> None:
        nonlocal found
        found = True
        if args.json:
            results.append(result.to_json())
            return
        print(result.line(), flush=not single)
        if result.outcome == "diverged" and single:
            print(f"  {result.message}")
        if args.trace:
            print(render_trace(result))

    summary = replay_all(
        histories,
        registry,
        workflow=args.workflow,
        until_seq=args.until_seq,
        trace=args.trace,
        on_result=show,
        progress=None if single else sys.stderr,
        total=total,
    )
    if args.instance is not None and not found:
        raise StepstreamError(f"no history of instance {args.instance!r} in {_where(args)}")
    if args.json:
        print(json.dumps({"instances": results, "summary": summary.to_json()}, indent=2))
    else:
        print(
            f"replayed {summary.replayed} {'history' if summary.replayed == 1 else 'histories'} "
            f"in {summary.seconds:.2f} s"
            f"{': ' + summary.describe() if summary.replayed else ''}",
            file=sys.stderr,
        )
    return 1 if summary.failed else 0


def _where(args: Any) -> str:
    if args.data is not None:
        return f"data directory {args.data}"
    if args.connect is not None:
        return str(args.connect)
    if args.bootstrap is not None:
        return f"the history topic of prefix {args.prefix or 'stepstream'}"
    return ", ".join(args.file)


def _histories(args: Any) -> tuple[Iterable[History], int | None]:
    """The histories the arguments name, and how many there are when that is known."""
    found: list[History]
    if args.data is not None:
        return read_data_dir(args.data, instance_id=args.instance), None
    if args.file is not None:
        found = read_files(args.file)
    elif args.bootstrap is not None:
        from stepstream.engine.config.kafka import KafkaSettings

        settings = KafkaSettings.load(
            args.bootstrap, args.prefix, config_file=args.kafka_config, options=args.kafka_opt
        )
        found, unreadable = read_kafka(settings, from_offset=args.from_offset or 0)
        if unreadable:
            print(f"skipped {unreadable} unreadable history records", file=sys.stderr)
    else:
        found = event_loop.run(_from_client(args))
    if args.instance is not None:
        found = [h for h in found if h.instance_id == args.instance]
    return found, len(found)


async def _from_client(args: Any) -> list[History]:
    import importlib

    from stepstream.producers.client import Client

    scheme = args.connect.split(":", 1)[0]
    if scheme == "kafka":
        importlib.import_module("stepstream.producers.kafka")
    options = {"token": args.token, "tls_ca": args.tls_ca}
    async with Client.connect(args.connect, **options) as client:
        return await read_client(client, instance_id=args.instance, workflow=args.workflow)
