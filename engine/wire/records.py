"""The record vocabulary: every command, history record, timer record and dead letter.

Records are frozen values (``engine.wire.values.record``: the type checker enforces it). Each
one carries the envelope of design.md (instance id, per-instance sequence, time, causing
command id, writer epoch, W3C trace context) and the attributes of its type. Avro schemas
in ``schemas/`` mirror these classes one to one (see ``engine.wire.serde``); the class name is
the Avro record name.
"""

from __future__ import annotations

from typing import ClassVar

from stepstream.engine.wire.values import record, value


@value
class Payload:
    """User data as opaque bytes plus the content type the codec wrote."""

    content_type: str
    data: bytes


@record
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

    # The record's type on the wire: its Avro record name, and ``type`` in every reader.
    # The class name unless a class says otherwise (three history records whose names the
    # errors of the same name would shadow: ``StepFailedRecord`` is a ``StepFailed``).
    type_name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: object) -> None:
        # Not super(): the slotted copy @record makes has no __class__ cell to match.
        super(Record, cls).__init_subclass__(**kwargs)  # noqa: UP008
        if "type_name" not in cls.__dict__:
            cls.type_name = cls.__name__

    @property
    def type(self) -> str:
        return self.type_name


# ---- commands -------------------------------------------------------------------------


@record
class Command(Record):
    topic_kind: ClassVar[str] = "commands"


@record
class StartWorkflow(Command):
    workflow: str
    version: str | None = None
    input: Payload
    # What a start of an existing instance id does: one of ``names.IF_EXISTS_POLICIES``.
    if_exists: str = "return"
    # Where the instance waits in its workflow's queue (lower first), and the key of a
    # per_key queue; both ignored by a workflow without a queue.
    priority: int | None = None
    queue_key: str | None = None


@record
class SendEvent(Command):
    name: str
    payload: Payload


@record
class CancelWorkflow(Command):
    reason: str = ""


@record
class TerminateWorkflow(Command):
    reason: str = ""


@record
class PauseWorkflow(Command):
    pass


@record
class ResumeWorkflow(Command):
    pass


@record
class TimerFired(Command):
    timer_id: str
    fire_at_ms: int


@record
class ResetWorkflow(Command):
    """Go on from just before the replay key ``to``: what was recorded from that key on
    is set aside (kept in the history, marked reset) and the code runs on from there."""

    to: str
    reason: str = ""


@record
class RetryWorkflow(Command):
    """Go on with a failed instance from its failed step, with fresh attempts."""

    reason: str = ""


@record
class ForkWorkflow(Command):
    """Sent to the source instance: start ``new_id`` with the source's history up to
    (not including) the replay key ``to``."""

    to: str
    new_id: str


@record
class StartFork(Command):
    """Sent by a fork's source to the new instance: the source's records before ``to``
    (Avro single-object encoded, as on the history topic), copied as its history."""

    source_id: str
    to: str
    records: list[bytes]


# ---- history --------------------------------------------------------------------------


@record
class HistoryRecord(Record):
    topic_kind: ClassVar[str] = "history"


@record
class WorkflowStarted(HistoryRecord):
    workflow: str
    version: str
    input: Payload
    priority: int | None = None
    queue_key: str | None = None


@record
class StepAttemptStarted(HistoryRecord):
    key: str
    attempt: int
    max_attempts: int
    deadline_ms: int | None = None


@record
class StepSucceeded(HistoryRecord):
    key: str
    attempt: int
    result: Payload


@record
class StepFailedRecord(HistoryRecord):
    """An attempt failed. ``next_attempt_at_ms`` is set when another attempt will run;
    None means the step failed for good and ``StepFailed`` is raised into the workflow.
    ``traceback``: where the exception was raised, for operators (schema v2)."""

    type_name: ClassVar[str] = "StepFailed"
    key: str
    attempt: int
    error_type: str
    error_message: str
    next_attempt_at_ms: int | None = None
    traceback: str | None = None


@record
class SleepStarted(HistoryRecord):
    key: str
    wake_at_ms: int


@record
class SleepElapsed(HistoryRecord):
    key: str


@record
class WaitStarted(HistoryRecord):
    key: str
    event_name: str
    timeout_at_ms: int | None = None


@record
class WaitSatisfied(HistoryRecord):
    key: str
    event_name: str
    payload: Payload
    event_command_id: str = ""


@record
class WaitTimedOut(HistoryRecord):
    key: str


@record
class EventBuffered(HistoryRecord):
    event_name: str
    payload: Payload


@record
class RaceDecided(HistoryRecord):
    """The first branch of a race to finish won; the open entries of the others (keys
    under the ``losers`` scope prefixes) are abandoned."""

    key: str
    winner: str
    losers: list[str]


@record
class CallRemoved(HistoryRecord):
    """The code no longer has the step, sleep or wait at ``key`` (``ctx.removed``), which
    was still open: it is abandoned (its attempt given up, its timer cancelled)."""

    key: str


@record
class LoopAdvanced(HistoryRecord):
    """An iteration of a loop ended with ``Continue``: the next iteration and its state;
    iterations older than the last ``keep`` are pruned."""

    key: str
    iteration: int
    state: Payload
    keep: int


@record
class ChildStarted(HistoryRecord):
    """The workflow started a child workflow (its StartWorkflow is published with this)."""

    key: str
    workflow: str
    child_id: str
    input: Payload


@record
class MessageWaitStarted(HistoryRecord):
    """The workflow waits for up to ``max`` messages of any of ``names``."""

    key: str
    names: list[str]
    max: int
    timeout_at_ms: int | None = None


@record
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


@record
class MessageSent(HistoryRecord):
    """The workflow sent a message to another instance."""

    key: str
    target: str
    name: str
    payload: Payload


@record
class MessageCompleted(HistoryRecord):
    """The workflow answered a message; a client's request() gets ``result``."""

    message_id: str
    result: Payload


@record
class ValueRecorded(HistoryRecord):
    """A non-deterministic value the workflow read (now, uuid, random), kept for replay."""

    key: str
    kind: str
    value: Payload


@record
class AttributesSet(HistoryRecord):
    """Search attributes the workflow set (``ctx.set_attributes``), merged into the
    instance's: a None value removes its key."""

    key: str
    attributes: dict[str, str | int | float | bool | None]


@record
class WorkflowPaused(HistoryRecord):
    pass


@record
class WorkflowResumed(HistoryRecord):
    pass


@record
class WorkflowCompleted(HistoryRecord):
    result: Payload


@record
class WorkflowFailedRecord(HistoryRecord):
    type_name: ClassVar[str] = "WorkflowFailed"
    error_type: str
    error_message: str
    traceback: str | None = None


@record
class WorkflowCancelledRecord(HistoryRecord):
    type_name: ClassVar[str] = "WorkflowCancelled"
    reason: str = ""


@record
class WorkflowReset(HistoryRecord):
    """The instance goes on from just before replay key ``to``: its records from
    ``from_seq`` up to this one are set aside (kept, no longer replayed). ``retry``: the
    reset of a failed instance to its failed step (``to`` is "" when no step failed:
    then only the failure is set aside)."""

    to: str
    from_seq: int
    reason: str = ""
    retry: bool = False


@record
class WorkflowForked(HistoryRecord):
    """The records before this one were copied from instance ``source_id``'s history up
    to (not including) its replay key ``to``, first set aside at its ``from_seq``."""

    source_id: str
    to: str
    from_seq: int


@record
class WorkflowTerminatedRecord(HistoryRecord):
    """The instance was ended at once (``terminate``): no compensations, no waiting."""

    type_name: ClassVar[str] = "WorkflowTerminated"
    reason: str = ""


@record
class WorkflowTimeoutSet(HistoryRecord):
    """The run has a time limit; its durable timer fires at ``timeout_at_ms``."""

    timeout_at_ms: int


@record
class WorkflowRestarted(HistoryRecord):
    """A start with ``if_exists="restart_if_failed"`` begins run ``run`` of an instance
    that ended ``previous_status``; what came before is kept but no longer replayed."""

    run: int
    previous_status: str


@record
class CommandIgnored(HistoryRecord):
    """A command that arrived for an instance that could not take it (finished, duplicate
    start, resume while running). Recorded so the audit trail shows it, then ignored."""

    command_type: str
    reason: str


@record
class InstanceForgotten(HistoryRecord):
    """A finished instance was forgotten once the retention had passed; readers drop it,
    and a later ``WorkflowStarted`` (seq 1) with its id begins a new instance."""

    finished_ms: int


@record
class PartitionFenced(HistoryRecord):
    """Written by a new owner of a partition before anything else; records of lower epochs
    that follow it are ignored by every reader. ``instance_id`` is empty."""

    partition: int


# ---- timers ---------------------------------------------------------------------------


@record
class TimerRecord(Record):
    topic_kind: ClassVar[str] = "timers"


@record
class TimerScheduled(TimerRecord):
    timer_id: str
    fire_at_ms: int
    purpose: str


@record
class TimerCancelled(TimerRecord):
    timer_id: str


# ---- snapshots ------------------------------------------------------------------------


@record
class SnapshotRecord(Record):
    topic_kind: ClassVar[str] = "snapshots"


@record
class StateChunk(SnapshotRecord):
    """Key/value pairs of a partition's state store, part ``index`` of a snapshot."""

    snapshot_id: str
    index: int
    previous_offset: int  # the newest complete snapshot's SnapshotTaken, or -1
    keys: list[bytes]
    values: list[bytes]


@record
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


@record
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
    ResetWorkflow,
    RetryWorkflow,
    ForkWorkflow,
    StartFork,
    TerminateWorkflow,
)
HISTORY_TYPES: tuple[type[HistoryRecord], ...] = (
    WorkflowStarted,
    StepAttemptStarted,
    StepSucceeded,
    StepFailedRecord,
    SleepStarted,
    SleepElapsed,
    WaitStarted,
    WaitSatisfied,
    WaitTimedOut,
    EventBuffered,
    ValueRecorded,
    AttributesSet,
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
    WorkflowFailedRecord,
    WorkflowCancelledRecord,
    CommandIgnored,
    PartitionFenced,
    InstanceForgotten,
    WorkflowReset,
    WorkflowForked,
    WorkflowTerminatedRecord,
    WorkflowTimeoutSet,
    WorkflowRestarted,
    CallRemoved,
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
