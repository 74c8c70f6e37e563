"""The hook runner of one partition (``consumers.hooks``) against an in-memory backend:
which records owe which calls, the outbox written ahead of the commit, the calls owed
by an earlier run (made if their record is durable, dropped if it never was), retries,
and nothing after ``halt``."""

from __future__ import annotations

import asyncio
import zlib
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepstream.consumers import state_keys as keys
from stepstream.consumers.hook_tasks import HookConfig, HookTask
from stepstream.consumers.hooks import HookRunner
from stepstream.consumers.log_context import TRACE_OF
from stepstream.engine.api.hook_events import StatusChangeEvent, StepErrorEvent
from stepstream.engine.api.workflow import Registry, definition_of, workflow
from stepstream.engine.replay.runtime import Output
from stepstream.engine.replay.state import InstanceState, Status
from stepstream.engine.replay.state_json import meta_json
from stepstream.engine.wire.records import (
    HistoryRecord,
    Payload,
    StepAttemptStarted,
    StepFailedRecord,
    StepSucceeded,
    WorkflowCompleted,
    WorkflowPaused,
    WorkflowResumed,
    WorkflowStarted,
)
from stepstream.engine.wire.serde import default_serde
from tests.fakes import FakeBackend

SERDE = default_serde()
CALLS: list[tuple[str, Any]] = []
RAISES: dict[str, int] = {}


def alert(event: StepErrorEvent) -> None:
    CALLS.append(("error", event))
    if RAISES.get("error", 0) > 0:
        RAISES["error"] -= 1
        raise RuntimeError("alerting is down")


async def audit(event: StatusChangeEvent) -> None:
    CALLS.append(("status", event))


@workflow("hooked", on_error=alert, on_status_change=audit)
async def hooked(ctx: Any, _: Any) -> None:
    pass


@workflow("plain")
async def plain(ctx: Any, _: Any) -> None:
    pass


@pytest.fixture(autouse=True)
def _clean() -> None:
    CALLS.clear()
    RAISES.clear()


def _runner(backend: FakeBackend, **config: Any) -> HookRunner:
    registry = Registry([hooked, plain])
    cfg = HookConfig(**{"backoff_s": 0.001, **config})
    return HookRunner(backend, registry, serde=SERDE, config=cfg)  # type: ignore[arg-type]


def _runtime(name: str, status: Status) -> Any:
    definition = definition_of(hooked if name == "hooked" else plain)
    return SimpleNamespace(definition=definition, state=InstanceState("i-1", status=status))


def _records(instance_id: str = "i-1") -> list[HistoryRecord]:
    common: dict[str, Any] = {"instance_id": instance_id, "epoch": 1}
    return [
        WorkflowStarted(
            **common, seq=1, time_ms=1000, workflow="hooked", version="1", input=Payload("a", b"")
        ),
        StepAttemptStarted(**common, seq=2, time_ms=1001, key="s", attempt=1, max_attempts=3),
        StepFailedRecord(
            **common,
            seq=3,
            time_ms=1002,
            key="s",
            attempt=1,
            error_type="E",
            error_message="m",
            next_attempt_at_ms=5000,
        ),
    ]


async def _settle(runner: HookRunner) -> None:
    assert await runner.drain(5) == 0


async def test_records_owe_calls_written_ahead_and_made_after_the_commit() -> None:
    backend = FakeBackend()
    runner = _runner(backend)
    out = Output(history=_records())
    await runner.write_ahead(out, {"i-1": _runtime("hooked", Status.RUNNING)})
    # Written ahead: one task per reported record, with the record's CRC.
    [ahead] = backend.commits
    assert sorted(ahead.puts) == [keys.hook("i-1", 1), keys.hook("i-1", 2), keys.hook("i-1", 3)]
    assert CALLS == []  # nothing runs before the commit of the records
    for record in out.history:  # the processor's commit
        backend.store.data[keys.history("i-1", record.seq)] = SERDE.encode(record)
    runner.launch()
    await _settle(runner)
    assert [(kind, getattr(e, "new_status", None)) for kind, e in CALLS] == [
        ("status", "pending"),
        ("status", "running"),
        ("error", None),
    ]
    error = CALLS[2][1]
    assert error == StepErrorEvent(
        instance_id="i-1",
        workflow="hooked",
        version="1",
        step="s",
        attempt=1,
        will_retry=True,
        retry_at=datetime.fromtimestamp(5, tz=UTC),
        error_type="E",
        message="m",
    )
    assert CALLS[0][1].old_status is None and CALLS[1][1].old_status == "pending"
    assert not [k for k in backend.store.data if k.startswith(keys.HOOK)]  # all deleted


async def test_workflows_without_hooks_owe_nothing() -> None:
    backend = FakeBackend()
    runner = _runner(backend)
    await runner.write_ahead(Output(history=_records()), {"i-1": _runtime("plain", Status.RUNNING)})
    runner.launch()
    assert backend.commits == [] and runner.owed == 0


async def test_the_status_before_a_batch_comes_from_the_stored_state() -> None:
    backend = FakeBackend()
    stored = InstanceState("i-1", workflow="hooked", version="1", status=Status.PAUSED)
    backend.store.data[keys.meta("i-1")] = meta_json(stored)
    runner = _runner(backend)
    records: list[HistoryRecord] = [
        WorkflowResumed(instance_id="i-1", seq=7, time_ms=1),
        StepSucceeded(
            instance_id="i-1", seq=8, time_ms=2, key="s", attempt=1, result=Payload("a", b"")
        ),
        WorkflowPaused(instance_id="i-1", seq=9, time_ms=3),
        WorkflowResumed(instance_id="i-1", seq=10, time_ms=4),
        WorkflowCompleted(instance_id="i-1", seq=11, time_ms=5, result=Payload("a", b"")),
    ]
    for record in records:
        backend.store.data[keys.history("i-1", record.seq)] = SERDE.encode(record)
    await runner.write_ahead(Output(history=records), {"i-1": _runtime("hooked", Status.COMPLETED)})
    runner.launch()
    await _settle(runner)
    assert [(e.old_status, e.new_status) for _, e in CALLS] == [
        ("paused", "running"),
        ("running", "paused"),
        ("paused", "running"),
        ("running", "completed"),
    ]


async def test_calls_owed_by_an_earlier_run_are_made_if_their_record_is_durable() -> None:
    backend = FakeBackend()
    records = _records()
    durable, lost = records[2], records[1]
    backend.store.data[keys.history("i-1", durable.seq)] = SERDE.encode(durable)
    # A different record under seq 2 (its commit never finished; another took the seq).
    other = StepAttemptStarted(
        instance_id="i-1", seq=2, time_ms=9, key="t", attempt=1, max_attempts=1
    )
    backend.store.data[keys.history("i-1", 2)] = SERDE.encode(other)
    for record in (lost, durable):
        event = StepErrorEvent("i-1", "hooked", "1", "s", record.seq, False, None, "E", "m")
        task = HookTask(
            keys.hook("i-1", record.seq), "error", zlib.crc32(SERDE.encode(record)), event
        )
        backend.store.data[task.key] = task.to_json()
    # A task whose record is not in the store at all.
    gone = HookTask(
        keys.hook("i-2", 1),
        "error",
        1,
        StepErrorEvent("i-2", "hooked", "1", "s", 1, False, None, "E", "m"),
    )
    backend.store.data[gone.key] = gone.to_json()

    runner = _runner(backend)
    runner.launch()  # the first launch loads what the store owes
    await _settle(runner)
    assert [e.attempt for _, e in CALLS] == [durable.seq]
    assert not [k for k in backend.store.data if k.startswith(keys.HOOK)]


async def test_a_raising_hook_is_retried_then_dropped() -> None:
    backend = FakeBackend()
    runner = _runner(backend, attempts=3)
    RAISES["error"] = 10
    records = _records()[2:]
    for record in records:
        backend.store.data[keys.history("i-1", record.seq)] = SERDE.encode(record)
    await runner.write_ahead(Output(history=records), {"i-1": _runtime("hooked", Status.RUNNING)})
    runner.launch()
    await _settle(runner)
    assert [kind for kind, _ in CALLS] == ["error"] * 3
    assert not [k for k in backend.store.data if k.startswith(keys.HOOK)]


async def test_nothing_runs_after_halt_and_the_task_stays_owed() -> None:
    backend = FakeBackend()
    runner = _runner(backend)
    records = _records()[2:]
    await runner.write_ahead(Output(history=records), {"i-1": _runtime("hooked", Status.RUNNING)})
    runner.halt()
    runner.launch()
    await asyncio.sleep(0.05)
    await runner.stop()
    assert CALLS == []
    assert [k for k in backend.store.data if k.startswith(keys.HOOK)] == [keys.hook("i-1", 3)]


def test_a_hook_must_be_callable() -> None:
    with pytest.raises(TypeError, match=r"on_error=.* is not callable"):
        workflow("x", on_error="alert")  # type: ignore[arg-type]
    definition = definition_of(hooked)
    assert definition is not None and definition.on_error is alert and definition.has_hooks
    assert not definition_of(plain).has_hooks  # type: ignore[union-attr]


def test_tasks_read_back() -> None:
    at = datetime(2030, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    for event in (
        StepErrorEvent("i\x00d", "w", "2", "a/b#2", 4, True, at, "T", "msg"),
        StepErrorEvent("id", "w", "2", "s", 4, False, None, "T", "msg"),
        StatusChangeEvent("id", "w", "2", None, "pending", at, None),
        StatusChangeEvent("id", "w", "2", "running", "failed", at, "E: boom"),
    ):
        kind = "error" if isinstance(event, StepErrorEvent) else "status"
        task = HookTask(keys.hook(event.instance_id, 3), kind, 123, event)
        assert HookTask.from_json(task.key, task.to_json()) == task
        for run in ((1000, None), (1000, "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")):
            traced = HookTask(task.key, kind, 123, event, run)
            assert HookTask.from_json(task.key, traced.to_json()) == traced


def test_a_task_names_its_instance_and_run_trace_in_log_fields() -> None:
    """Its log lines carry the run's trace (made into trace_id and span_id by the log
    formatter); one stored by an older release, without the run, still reads back."""
    event = StepErrorEvent("i-1", "w", "1", "s", 1, True, None, "E", "m")
    key = keys.hook("i-1", 3)
    task = HookTask(key, "error", 1, event, (1000, None))
    fields = task.log_fields(partition=2)
    assert fields[TRACE_OF] == ("i-1", 1000, None)
    assert {k: fields[k] for k in ("instance_id", "workflow", "hook", "seq", "partition")} == {
        "instance_id": "i-1",
        "workflow": "w",
        "hook": "on_error",
        "seq": 3,
        "partition": 2,
    }
    older = HookTask.from_json(key, HookTask(key, "error", 1, event).to_json())
    assert older.run is None and TRACE_OF not in older.log_fields(partition=2)


async def test_tasks_carry_the_run_of_their_instance() -> None:
    backend = FakeBackend()
    runner = _runner(backend)
    runtime = _runtime("hooked", Status.RUNNING)
    runtime.state.created_ms, runtime.state.traceparent = 1000, None
    await runner.write_ahead(Output(history=_records()), {"i-1": runtime})
    stored = [HookTask.from_json(k, v) for k, v in backend.store.scan(keys.HOOK)]
    assert stored and all(task.run == (1000, None) for task in stored)


ids = st.text(alphabet=st.sampled_from("a\x00\x01\x02/#é") | st.characters(), min_size=1)


@given(ids, ids, st.integers(min_value=0, max_value=2**63))
def test_hook_keys_read_back_and_stay_apart(a: str, b: str, seq: int) -> None:
    try:
        a.encode(), b.encode()
    except UnicodeEncodeError:
        return
    assert keys.split_hook(keys.hook(a, seq)) == (a, seq)
    if a != b:
        assert not keys.hook(a, seq).startswith(keys.hook(b, seq)[:-8])
