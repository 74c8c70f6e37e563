"""What a command read from the log must pass before it is applied: it decodes, it is a
command, its names and payload are valid, and it is on its instance's partition.

Clients check names and payloads before publishing; this catches what got past them (a
foreign producer, a record written by hand, a bug).
"""

from __future__ import annotations

from dataclasses import dataclass

from stepstream.engine.api.reserved_ids import is_engine_instance, reserved_id_problem
from stepstream.engine.errors import StepstreamError, UndecodableRecord
from stepstream.engine.replay.ids import (
    child_command_run,
    child_done,
    is_child_notice,
    parse_child_command,
)
from stepstream.engine.replay.outgoing import child_outcome
from stepstream.engine.seams import Clock, LogEntry
from stepstream.engine.wire.codec import (
    JSON,
    PayloadCodec,
    check_size,
    decode_safely,
    encode_safely,
)
from stepstream.engine.wire.names import event_name_problem, name_problem
from stepstream.engine.wire.records import Command, SendEvent, StartFork, StartWorkflow, TimerFired
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.topics import partition_for


@dataclass(frozen=True, slots=True)
class Rejected:
    """A command that is dead-lettered rather than applied, and why."""

    instance_id: str
    command_id: str
    reason: str


class CommandIntake:
    def __init__(
        self,
        *,
        serde: RecordSerde,
        codec: PayloadCodec,
        clock: Clock,
        partition: int,
        partitions: int,
        max_payload_bytes: int,
    ) -> None:
        self._serde = serde
        self._codec = codec
        self._clock = clock
        self._partition = partition
        self._partitions = partitions
        self._max_payload_bytes = max_payload_bytes

    def read(self, entry: LogEntry) -> Command | Rejected:
        """The command ``entry`` holds, or why it is rejected: undecodable, not a command,
        a bad payload, or on the wrong partition."""
        try:
            record = self._serde.decode(entry.value)
        except UndecodableRecord as exc:
            return Rejected("", "", f"undecodable record: {exc}")
        if not isinstance(record, Command):
            return Rejected(
                record.instance_id, record.command_id, f"{record.type} is not a command"
            )
        problem = self._payload_problem(record)
        if problem is not None:
            return Rejected(record.instance_id, record.command_id, problem)
        home = partition_for(record.instance_id, self._partitions)
        if home != self._partition:
            return Rejected(
                record.instance_id,
                record.command_id,
                f"misrouted: instance {record.instance_id!r} lives on partition {home}, this "
                f"record is on partition {self._partition}; produce commands keyed by "
                "instance id with Kafka's murmur2 partitioner (librdkafka: "
                "partitioner=murmur2_random)",
            )
        return record

    def child_failed(self, start: StartWorkflow, exc: StepstreamError) -> Command | None:
        """The notice a child that cannot start (its workflow is not deployed here) sends
        its parent, which would otherwise wait for it for ever; None when ``start`` was
        not a child's."""
        parent = parse_child_command(start.command_id)
        if parent is None:
            return None
        parent_id, key = parent
        outcome = {"status": "failed", "error_type": type(exc).__name__, "error": str(exc)}
        return child_outcome(
            parent_id,
            key,
            child_done(start.instance_id, child_command_run(start.command_id)),
            encode_safely(self._codec, outcome),
            self._clock.now_ms(),
        )

    def _payload_problem(self, command: Command) -> str | None:
        if not isinstance(command, TimerFired):
            problem = name_problem(command.instance_id)
            if problem is not None:
                return f"InvalidPayload: instance id {problem}"
        if isinstance(command, StartWorkflow | StartFork):
            # Any producer may write commands (a source, a Kafka tool): the engine's own
            # instances (schedules, queues) must stand where their ids say.
            workflow = command.workflow if isinstance(command, StartWorkflow) else None
            problem = reserved_id_problem(command.instance_id, workflow)
            if problem is not None:
                return f"InvalidPayload: instance id {command.instance_id!r} {problem}"
        if isinstance(command, SendEvent):
            # Any producer may write commands: ``~`` names are the engine's own (a child's
            # notice to its parent), refused from anyone else as the clients refuse them.
            own = is_child_notice(command.name, command.command_id)
            problem = (name_problem if own else event_name_problem)(command.name)
            if problem is not None:
                return f"InvalidPayload: event name {problem}"
        if isinstance(command, StartWorkflow):
            payload, what = command.input, "workflow input"
        elif isinstance(command, SendEvent):
            payload, what = command.payload, f"payload of event {command.name!r}"
        else:
            return None
        try:
            check_size(payload, self._max_payload_bytes, what=what)
        except StepstreamError as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            decode_safely(self._codec, payload)
        except StepstreamError as exc:
            if (
                isinstance(command, SendEvent)
                and payload.content_type != JSON
                and not is_engine_instance(command.instance_id)
            ):
                # Sealed by a codec (or under a key) this engine lacks, not malformed
                # JSON: a message or event for a workflow's instance is kept, as its other
                # values are; it parks when it reads it, and goes on where an engine with
                # that codec does (docs/encryption.md). A schedule or queue reads every
                # message it gets and could never go on: refused as before.
                return None
            return f"{type(exc).__name__}: {exc}"
        return None
