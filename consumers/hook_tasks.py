"""What a hook call owed is: its settings, the task stored in the partition's outbox,
and the event a history record gives the workflow's ``on_error`` or
``on_status_change`` hook."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from stepstream.consumers import state_keys as keys
from stepstream.consumers.log_context import TRACE_OF
from stepstream.engine.api.hook_events import StatusChangeEvent, StepErrorEvent
from stepstream.engine.api.workflow import WorkflowDefinition
from stepstream.engine.config.environ import env_int, env_seconds
from stepstream.engine.replay.state import InstanceState, Status
from stepstream.engine.wire.records import (
    HistoryRecord,
    StepFailedRecord,
    WorkflowCancelledRecord,
    WorkflowFailedRecord,
    WorkflowStarted,
    WorkflowTerminatedRecord,
)

DEFAULT_HOOK_ATTEMPTS = 5
DEFAULT_HOOK_BACKOFF_S = 0.5
DEFAULT_HOOK_TIMEOUT_S = 60.0
DEFAULT_HOOK_THREADS = 8
MAX_HOOK_BACKOFF_S = 30.0
ERROR = "error"
STATUS = "status"


@dataclass(frozen=True, slots=True)
class HookConfig:
    attempts: int = DEFAULT_HOOK_ATTEMPTS  # calls of one event before it is dropped
    backoff_s: float = DEFAULT_HOOK_BACKOFF_S  # before the 2nd call, doubling after
    timeout_s: float = DEFAULT_HOOK_TIMEOUT_S  # one call longer than this has failed
    threads: int = DEFAULT_HOOK_THREADS  # sync hooks running at once, per partition

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> HookConfig:
        """From ``STEPSTREAM_HOOK_ATTEMPTS``, ``_BACKOFF_S``, ``_TIMEOUT_S``, ``_THREADS``."""
        return cls(
            attempts=env_int(env, "STEPSTREAM_HOOK_ATTEMPTS", DEFAULT_HOOK_ATTEMPTS),
            backoff_s=env_seconds(env, "STEPSTREAM_HOOK_BACKOFF_S", DEFAULT_HOOK_BACKOFF_S),
            timeout_s=env_seconds(env, "STEPSTREAM_HOOK_TIMEOUT_S", DEFAULT_HOOK_TIMEOUT_S),
            threads=env_int(env, "STEPSTREAM_HOOK_THREADS", DEFAULT_HOOK_THREADS),
        )


@dataclass(frozen=True, slots=True)
class HookTask:
    """One hook call owed: which hook, the event's fields, and the record it reports."""

    key: bytes
    kind: str  # ERROR or STATUS
    crc: int  # CRC-32 of the encoded record (``state_keys.history`` holds it once durable)
    event: StepErrorEvent | StatusChangeEvent
    # The instance's run (its start ms, and the traceparent its start carried), which its
    # log lines' trace and span ids come from; None for a task stored by an older release.
    run: tuple[int, str | None] | None = None

    @property
    def instance_id(self) -> str:
        return self.event.instance_id

    def log_fields(self, partition: int) -> dict[str, Any]:
        """What a log line about this call says about it (``extra=``): the instance, its
        workflow and its run's trace (``log_context.TRACE_OF``), the hook and the record."""
        fields: dict[str, Any] = {
            "instance_id": self.instance_id,
            "workflow": self.event.workflow,
            "hook": "on_error" if self.kind == ERROR else "on_status_change",
            "seq": keys.split_hook(self.key)[1],
            "partition": partition,
        }
        if self.run is not None:
            fields[TRACE_OF] = (self.instance_id, *self.run)
        return fields

    def to_json(self) -> bytes:
        e = self.event
        raw: dict[str, Any] = {"k": self.kind, "c": self.crc, "w": e.workflow, "v": e.version}
        if self.run is not None:
            raw.update(rs=self.run[0], tp=self.run[1])
        if isinstance(e, StepErrorEvent):
            raw.update(
                s=e.step,
                a=e.attempt,
                r=None if e.retry_at is None else _ms(e.retry_at),
                t=e.error_type,
                m=e.message,
            )
        else:
            raw.update(o=e.old_status, n=e.new_status, at=_ms(e.at), e=e.error)
        return orjson.dumps(raw)

    @classmethod
    def from_json(cls, key: bytes, value: bytes) -> HookTask:
        instance_id, _ = keys.split_hook(key)
        raw = orjson.loads(value)
        event: StepErrorEvent | StatusChangeEvent
        if raw["k"] == ERROR:
            event = StepErrorEvent(
                instance_id=instance_id,
                workflow=raw["w"],
                version=raw["v"],
                step=raw["s"],
                attempt=raw["a"],
                will_retry=raw["r"] is not None,
                retry_at=None if raw["r"] is None else _time(raw["r"]),
                error_type=raw["t"],
                message=raw["m"],
            )
        else:
            event = StatusChangeEvent(
                instance_id=instance_id,
                workflow=raw["w"],
                version=raw["v"],
                old_status=raw["o"],
                new_status=raw["n"],
                at=_time(raw["at"]),
                error=raw["e"],
            )
        run = (raw["rs"], raw.get("tp")) if "rs" in raw else None
        return cls(key, raw["k"], raw["c"], event, run)


class HookSubject:
    """A hook call being made, as the subject of the lines logged meanwhile
    (``log_context.LogSubject``): the runner's and the hook's own."""

    __slots__ = ("partition", "task")

    def __init__(self, task: HookTask, partition: int) -> None:
        self.task = task
        self.partition = partition

    def log_fields(self) -> dict[str, Any]:
        return self.task.log_fields(self.partition)


def _time(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def _ms(at: datetime) -> int:
    return round(at.timestamp() * 1000)


def error_event(record: StepFailedRecord, definition: WorkflowDefinition) -> StepErrorEvent:
    retry_at = record.next_attempt_at_ms
    return StepErrorEvent(
        instance_id=record.instance_id,
        workflow=definition.name,
        version=definition.version,
        step=record.key,
        attempt=record.attempt,
        will_retry=retry_at is not None,
        retry_at=None if retry_at is None else _time(retry_at),
        error_type=record.error_type,
        message=record.error_message,
    )


def status_event(
    record: HistoryRecord, definition: WorkflowDefinition, old: Status | None, new: Status
) -> StatusChangeEvent:
    return StatusChangeEvent(
        instance_id=record.instance_id,
        workflow=definition.name,
        version=definition.version,
        old_status=None if old is None else old.value,
        new_status=new.value,
        at=_time(record.time_ms),
        error=_error_of(record),
    )


def status_after(
    old: Status | None, record: HistoryRecord, *, paused_pending: bool = False
) -> Status:
    """The status after ``record``, by the instance state machine itself: a scratch
    state with only the status (and whether a pause caught it pending, which a resume
    goes back to) is folded (records that need an instance's entries change no
    status)."""
    if isinstance(record, WorkflowStarted):
        return Status.PENDING
    scratch = InstanceState(record.instance_id, status=old or Status.PENDING, seq=record.seq - 1)
    scratch.paused_pending = paused_pending
    with contextlib.suppress(Exception):  # KeyError: a record about an entry
        scratch.apply(record)
    return scratch.status


def _error_of(record: HistoryRecord) -> str | None:
    if isinstance(record, WorkflowFailedRecord):
        return f"{record.error_type}: {record.error_message}"
    if isinstance(record, WorkflowCancelledRecord) and record.reason:
        return f"cancelled: {record.reason}"
    if isinstance(record, WorkflowTerminatedRecord) and record.reason:
        return f"terminated: {record.reason}"
    return None
