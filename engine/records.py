"""The record vocabulary: every command, history record, timer record and dead letter.

Records are frozen values. Each one carries the envelope of design.md (instance id,
per-instance sequence, time, causing command id, writer epoch, W3C trace context) and
the attributes of its type. Avro schemas in ``schemas/`` mirror these classes one to one
(see ``engine.serde``); the class name is the Avro record name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class Payload:
    """User data as opaque bytes plus the content type the codec wrote."""

    content_type: str
    data: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    """Envelope shared by every record on every topic."""

    topic_kind: ClassVar[str] = ""
    instance_id: str
    seq: int = 0
    time_ms: int = 0
    command_id: str = ""
    epoch: int = 0
    traceparent: str | None = None
    tracestate: str | None = None

    @property
    def type(self) -> str:
        return type(self).__name__


# ---- commands -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Command(Record):
    topic_kind: ClassVar[str] = "commands"


@dataclass(frozen=True, slots=True, kw_only=True)
class StartWorkflow(Command):
    workflow: str
    version: str | None = None
    input: Payload


@dataclass(frozen=True, slots=True, kw_only=True)
class SendEvent(Command):
    name: str
    payload: Payload


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelWorkflow(Command):
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PauseWorkflow(Command):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeWorkflow(Command):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerFired(Command):
    timer_id: str
    fire_at_ms: int


# ---- history --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryRecord(Record):
    topic_kind: ClassVar[str] = "history"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowStarted(HistoryRecord):
    workflow: str
    version: str
    input: Payload


@dataclass(frozen=True, slots=True, kw_only=True)
class StepAttemptStarted(HistoryRecord):
    key: str
    attempt: int
    max_attempts: int
    deadline_ms: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSucceeded(HistoryRecord):
    key: str
    attempt: int
    result: Payload


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFailed(HistoryRecord):
    """An attempt failed. ``next_attempt_at_ms`` is set when another attempt will run;
    None means the step failed for good and ``StepFailed`` is raised into the workflow."""

    key: str
    attempt: int
    error_type: str
    error_message: str
    next_attempt_at_ms: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SleepStarted(HistoryRecord):
    key: str
    wake_at_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SleepElapsed(HistoryRecord):
    key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitStarted(HistoryRecord):
    key: str
    event_name: str
    timeout_at_ms: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitSatisfied(HistoryRecord):
    key: str
    event_name: str
    payload: Payload
    event_command_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitTimedOut(HistoryRecord):
    key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EventBuffered(HistoryRecord):
    event_name: str
    payload: Payload


@dataclass(frozen=True, slots=True, kw_only=True)
class RaceDecided(HistoryRecord):
    """The first branch of a race to finish won; the open entries of the others (keys
    under the ``losers`` scope prefixes) are abandoned."""

    key: str
    winner: str
    losers: list[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopAdvanced(HistoryRecord):
    """An iteration of a loop ended with ``Continue``: the next iteration and its state;
    iterations older than the last ``keep`` are pruned."""

    key: str
    iteration: int
    state: Payload
    keep: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildStarted(HistoryRecord):
    """The workflow started a child workflow (its StartWorkflow is published with this)."""

    key: str
    workflow: str
    child_id: str
    input: Payload


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageWaitStarted(HistoryRecord):
    """The workflow waits for up to ``max`` messages of any of ``names``."""

    key: str
    names: list[str]
    max: int
    timeout_at_ms: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MessagesReceived(HistoryRecord):
    """A message wait took these messages, in arrival order."""

    key: str
    ids: list[str]
    names: list[str]
    content_types: list[str]
    data: list[bytes]
    sent_ms: list[int]

    @property
    def payloads(self) -> list[Payload]:
        return [Payload(t, d) for t, d in zip(self.content_types, self.data, strict=True)]


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageSent(HistoryRecord):
    """The workflow sent a message to another instance."""

    key: str
    target: str
    name: str
    payload: Payload


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageCompleted(HistoryRecord):
    """The workflow answered a message; a client's request() gets ``result``."""

    message_id: str
    result: Payload


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueRecorded(HistoryRecord):
    """A non-deterministic value the workflow read (now, uuid, random), kept for replay."""

    key: str
    kind: str
    value: Payload


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowPaused(HistoryRecord):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowResumed(HistoryRecord):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowCompleted(HistoryRecord):
    result: Payload


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowFailed(HistoryRecord):
    error_type: str
    error_message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowCancelled(HistoryRecord):
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandIgnored(HistoryRecord):
    """A command that arrived for an instance that could not take it (finished, duplicate
    start, resume while running). Recorded so the audit trail shows it, then ignored."""

    command_type: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceForgotten(HistoryRecord):
    """A finished instance was forgotten once the retention had passed; readers drop it,
    and a later ``WorkflowStarted`` (seq 1) with its id begins a new instance."""

    finished_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionFenced(HistoryRecord):
    """Written by a new owner of a partition before anything else; records of lower epochs
    that follow it are ignored by every reader. ``instance_id`` is empty."""

    partition: int


# ---- timers ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerRecord(Record):
    topic_kind: ClassVar[str] = "timers"


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerScheduled(TimerRecord):
    timer_id: str
    fire_at_ms: int
    purpose: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerCancelled(TimerRecord):
    timer_id: str


# ---- snapshots ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRecord(Record):
    topic_kind: ClassVar[str] = "snapshots"


@dataclass(frozen=True, slots=True, kw_only=True)
class StateChunk(SnapshotRecord):
    """Key/value pairs of a partition's state store, part ``index`` of a snapshot."""

    snapshot_id: str
    index: int
    previous_offset: int  # the newest complete snapshot's SnapshotTaken, or -1
    keys: list[bytes]
    values: list[bytes]


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotTaken(SnapshotRecord):
    """Closes a complete snapshot: its chunks start at ``first_offset`` and it covers the
    history before ``history_offset`` (whose last record has CRC-32 ``history_tail``)."""

    snapshot_id: str
    partition: int
    first_offset: int
    chunks: int
    entries: int
    history_offset: int
    history_tail: int
    commands_offset: int
    timers_offset: int


# ---- dead letters ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetter(Record):
    topic_kind: ClassVar[str] = "dead-letters"
    source_topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    reason: str


COMMAND_TYPES: tuple[type[Command], ...] = (
    StartWorkflow,
    SendEvent,
    CancelWorkflow,
    PauseWorkflow,
    ResumeWorkflow,
    TimerFired,
)
HISTORY_TYPES: tuple[type[HistoryRecord], ...] = (
    WorkflowStarted,
    StepAttemptStarted,
    StepSucceeded,
    StepFailed,
    SleepStarted,
    SleepElapsed,
    WaitStarted,
    WaitSatisfied,
    WaitTimedOut,
    EventBuffered,
    ValueRecorded,
    RaceDecided,
    LoopAdvanced,
    ChildStarted,
    MessageWaitStarted,
    MessagesReceived,
    MessageSent,
    MessageCompleted,
    WorkflowPaused,
    WorkflowResumed,
    WorkflowCompleted,
    WorkflowFailed,
    WorkflowCancelled,
    CommandIgnored,
    PartitionFenced,
    InstanceForgotten,
)
TIMER_TYPES: tuple[type[TimerRecord], ...] = (TimerScheduled, TimerCancelled)
SNAPSHOT_TYPES: tuple[type[SnapshotRecord], ...] = (StateChunk, SnapshotTaken)
ALL_TYPES: tuple[type[Record], ...] = (
    *COMMAND_TYPES,
    *HISTORY_TYPES,
    *TIMER_TYPES,
    DeadLetter,
    *SNAPSHOT_TYPES,
)
