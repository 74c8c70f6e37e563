"""Replaying histories: ``replay_history`` runs the current code of one history's
workflow version against it and says whether, and where, the code no longer matches;
``replay_all`` does it for many."""

from __future__ import annotations

import ast
import dataclasses
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import HistoryDiverged, StepstreamError, UnknownWorkflow
from stepstream.engine.replay.effects import Output
from stepstream.engine.replay.reset import fold, set_aside
from stepstream.engine.wire.codec import JsonCodec, PayloadCodec, decode_safely
from stepstream.engine.wire.records import (
    AttributesSet,
    HistoryRecord,
    StepAttemptStarted,
    ValueRecorded,
    WaitStarted,
    WorkflowCancelledRecord,
    WorkflowCompleted,
    WorkflowFailedRecord,
    WorkflowPaused,
    WorkflowRestarted,
    WorkflowResumed,
    WorkflowStarted,
)
from stepstream.engine.wire.records import SleepStarted as SleepStartedRecord
from stepstream.ops.tools.replay.results import ReplayResult, ReplaySummary, TraceStep
from stepstream.ops.tools.replay.runtime import FixedClock, NotedCall, ReplayRuntime
from stepstream.ops.tools.replay.sources import History

DIVERGED_TYPE = "HistoryDiverged"
_INVALID_PAYLOAD = "InvalidPayload"
PROGRESS_EVERY = 1000
_TERMINAL = (WorkflowCompleted, WorkflowFailedRecord, WorkflowCancelledRecord)
# Records that open a new replay key: the code made a call the history does not have.
_NEW_CALLS: dict[type[HistoryRecord], str] = {
    StepAttemptStarted: "step",
    SleepStartedRecord: "sleep",
    WaitStarted: "wait",
    ValueRecorded: "value",
    AttributesSet: "attributes",
}
_QUOTED = re.compile(r"history has \w+ ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")


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
    # The run the code replays: the last (``if_exists="restart_if_failed"`` begins another
    # after a failed, cancelled or terminated one, perhaps of another workflow). Earlier
    # runs fold as they ended; only the last one's end is left for the code to reach.
    aside = set_aside(records)
    restarts = [r.seq for r in records if isinstance(r, WorkflowRestarted) and r.seq not in aside]
    run_from = restarts[-1] if restarts else 0
    current = next(
        (r for r in records if isinstance(r, WorkflowStarted) and r.seq > run_from), started
    )

    def made(outcome: str, **details: Any) -> ReplayResult:
        return ReplayResult(
            instance_id=history.instance_id,
            workflow=current.workflow if current is not None else "",
            version=current.version if current is not None else "",
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
    assert current is not None
    try:
        definition = registry.resolve(current.workflow, current.version)
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

    end: HistoryRecord | None = None
    try:
        # What a reset set aside does not count (engine.replay.reset); the terminal
        # record kept is the one that still counts, if any.
        counted = []
        for record in records:
            if isinstance(record, _TERMINAL) and record.seq > run_from:
                end = record if record.seq not in aside else end
            elif not isinstance(record, WorkflowPaused | WorkflowResumed):
                # Pauses only stop the code between commands; replay runs it regardless.
                counted.append(record)
        state = fold(history.instance_id, counted)
    except Exception as exc:
        return made("error", message=f"folding the history raised {type(exc).__name__}: {exc}")
    recorded = {key: (e.kind.value, e.seq) for key, e in state.entries.items()}
    runtime = ReplayRuntime(
        state,
        # As registered (its queue, its timeout, its hooks), the code noted.
        dataclasses.replace(definition, fn=noted),
        codec=codec or JsonCodec(),
        clock=FixedClock(records[-1].time_ms),
        epoch=max(r.epoch for r in records) + 1,
        trace=trace,
        ended=end is not None,
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
    undecodable = _undecodable(end, out, runtime.state.parked)
    if undecodable is not None:
        return made("error", message=undecodable, trace=steps)
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


def _undecodable(end: HistoryRecord | None, out: Output, parked: str) -> str | None:
    """The codec's refusal, when the replay parked or failed for want of reading a
    recorded payload (a codec other than the one that recorded them, a key missing): not
    a divergence of the code, and no verdict on it."""
    refusals = [parked] if parked.startswith(f"{_INVALID_PAYLOAD}: ") else []
    if not (isinstance(end, WorkflowFailedRecord) and end.error_type == _INVALID_PAYLOAD):
        # (a history that ended that way failed so when it ran too)
        refusals += [
            record.error_message
            for record in out.history
            if isinstance(record, WorkflowFailedRecord) and record.error_type == _INVALID_PAYLOAD
        ]
    if not refusals:
        return None
    return (
        f"a recorded payload cannot be decoded: {refusals[0]} (replay with the codec the "
        "engine recorded it with: --codec in the CLI, codec= to stepstream.testing.replay)"
    )


def _divergence(
    runtime: ReplayRuntime, out: Output, recorded: dict[str, tuple[str, int]], ended: list[str]
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


def _diverged_message(runtime: ReplayRuntime, out: Output) -> str | None:
    """The runtime's verdict, however it gives it: the HistoryDiverged it keeps, a
    WorkflowFailedRecord(HistoryDiverged) it decided, or the instance parked with a reason."""
    found = _diverged_error(runtime)
    if found is not None:
        return str(found)
    for record in out.history:
        if isinstance(record, WorkflowFailedRecord) and record.error_type == DIVERGED_TYPE:
            return record.error_message
    if runtime.state.parked and not runtime.state.status.finished:
        return runtime.state.parked
    return None


def _diverged_error(runtime: ReplayRuntime) -> HistoryDiverged | None:
    found = getattr(runtime, "diverged", None) or getattr(runtime, "_diverged", None)
    return found if isinstance(found, HistoryDiverged) else None


def _diverged_key(runtime: ReplayRuntime, message: str) -> str:
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
    calls: Sequence[NotedCall], recorded: dict[str, tuple[str, int]], ended: list[str]
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
    end: HistoryRecord | None, out: Output, calls: Sequence[NotedCall]
) -> tuple[str, str, str, str] | None:
    """A finished history whose code now ends otherwise, or makes new calls first."""
    if not isinstance(end, WorkflowCompleted | WorkflowFailedRecord):
        return None  # cancelled (or not finished): where the code stands is enough
    if isinstance(end, WorkflowFailedRecord) and end.error_type == DIVERGED_TYPE:
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
    elif isinstance(end, WorkflowFailedRecord) and not isinstance(finished, WorkflowFailedRecord):
        got = _ended(finished)
    else:
        return None
    return ("(end)", was, got, f"the history ends {was} at seq {end.seq}, the code now {got}")


def _ended(record: HistoryRecord) -> str:
    if isinstance(record, WorkflowFailedRecord):
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
