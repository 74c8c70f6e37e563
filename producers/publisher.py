"""Publishing commands to the commands log, and the log transport built on it.

``CommandPublisher`` checks a client's input (known workflow, encodable and small enough
payloads, instance not finished) before anything is published, publishes the command
and waits until the partition's owner has settled it. ``LogTransport`` adds reads from
an in-process owner (the embedded backend); the Kafka client adds reads over HTTP from
the owning worker (``producers.kafka``)."""

from __future__ import annotations

import abc
import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from stepstream.engine.api.reserved_ids import reserved_id_problem
from stepstream.engine.api.schedule_spec import scheduled_workflow
from stepstream.engine.api.workflow import WorkflowDefinition
from stepstream.engine.errors import (
    InvalidPayload,
    PayloadTooLarge,
    ResultTimeout,
    WorkflowCancelled,
    WorkflowFailed,
    WorkflowTerminated,
    WorkflowTimeout,
)
from stepstream.engine.reads.listing import InstancePage, ListQuery, Overview, merge_overviews
from stepstream.engine.reads.views import HistoryEntry, InstanceStatus, mark_set_aside
from stepstream.engine.replay.state import InstanceState, Status
from stepstream.engine.seams import Clock, SystemClock
from stepstream.engine.wire.codec import (
    MAX_MESSAGE_CHARS,
    PayloadCodec,
    check_size,
    decode_safely,
    encode_safely,
)
from stepstream.engine.wire.names import (
    check_if_exists,
    check_name,
    event_id_problem,
    event_name_problem,
    text_problem,
)
from stepstream.engine.wire.records import (
    CancelWorkflow,
    Command,
    ForkWorkflow,
    HistoryRecord,
    PauseWorkflow,
    Payload,
    ResetWorkflow,
    ResumeWorkflow,
    RetryWorkflow,
    SendEvent,
    StartWorkflow,
    TerminateWorkflow,
)
from stepstream.engine.wire.settle import error_for
from stepstream.producers import trace_context

# Instances one partition looks at per slice of a page (about a millisecond's work).
_LIST_SLICE = 2000


class WorkflowRef(Protocol):
    """A workflow name and the version a new instance of it gets (None: the latest one
    the worker that applies the start has)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str | None: ...


class Publishing(Protocol):
    """What publishing needs from the owners' side: which workflows they run (``resolve``
    raises ``UnknownWorkflow`` for a name, or a pinned version, that they do not have),
    and word of when a published command was applied (None) or dead-lettered (the
    reason)."""

    def resolve(self, workflow: str, version: str | None = None) -> WorkflowRef: ...

    def settled(self, instance_id: str, command_id: str) -> asyncio.Future[str | None]: ...

    def forget(self, instance_id: str, command_id: str) -> None: ...


class Reader(Publishing, Protocol):
    def resolve(self, workflow: str, version: str | None = None) -> WorkflowDefinition: ...

    def finished(self, instance_id: str) -> bool: ...

    def read_state(self, instance_id: str, *, entries: bool = True) -> InstanceState: ...

    def read_history(self, instance_id: str) -> list[HistoryRecord]: ...

    def list_instances(self) -> list[InstanceState]: ...

    def list_page(self, query: ListQuery, budget: int) -> InstancePage: ...

    def overview_slice(self, progress: Any, budget: int) -> tuple[Overview, Any]:
        """Part of the overview and where to go on from (opaque; None to start, None
        when done)."""
        ...

    async def wait_finished(self, instance_id: str, timeout: float | None) -> InstanceState: ...

    async def wait_reply(
        self, instance_id: str, message_id: str, timeout: float | None
    ) -> Payload: ...


def raise_for_outcome(state: InstanceState, codec: PayloadCodec) -> Any:
    """The result of a finished instance, or the error that describes how it ended."""
    if state.status is Status.COMPLETED:
        assert state.result is not None
        return decode_safely(codec, state.result)
    if state.status is Status.TERMINATED:
        raise WorkflowTerminated(
            f"instance {state.instance_id} was terminated: {state.cancel_reason or 'no reason'}",
            instance_id=state.instance_id,
            reason=state.cancel_reason,
        )
    if state.status is Status.CANCELLED:
        raise WorkflowCancelled(
            f"instance {state.instance_id} was cancelled: {state.cancel_reason or 'no reason'}",
            instance_id=state.instance_id,
            reason=state.cancel_reason,
        )
    failed = WorkflowTimeout if state.error_type == "WorkflowTimeout" else WorkflowFailed
    raise failed(
        f"instance {state.instance_id} failed: {state.error_type}: {state.error_message}",
        instance_id=state.instance_id,
        error_type=state.error_type,
    )


_ACTIONS = {
    "StartWorkflow": "start",
    "SendEvent": "sending an event",
    "CancelWorkflow": "cancel",
    "TerminateWorkflow": "terminate",
    "PauseWorkflow": "pause",
    "ResumeWorkflow": "resume",
    "ResetWorkflow": "reset",
    "RetryWorkflow": "retry",
    "ForkWorkflow": "fork",
}


class CommandPublisher(abc.ABC):
    """The command half of a transport; subclasses say how to read."""

    # Where commands go, for their producer spans (a Kafka transport names its topic).
    destination = trace_context.IN_PROCESS

    def __init__(
        self,
        publish: Callable[[Command], Awaitable[None]],
        publishing: Publishing,
        *,
        codec: PayloadCodec,
        max_payload_bytes: int,
        on_close: Callable[[], Awaitable[None]] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._publish = publish
        self._clock = clock or SystemClock()
        self._publishing = publishing
        self._codec = codec
        self._limit = max_payload_bytes
        self._on_close = on_close

    def _partition(self, instance_id: str) -> int:
        """The partition a command for ``instance_id`` goes to, for its producer span;
        -1 where the transport does not choose it."""
        return -1

    async def _submit(self, command: Command) -> None:
        """Publish ``command`` inside its producer span, which it carries (every command
        gets one here: a new kind of command needs nothing more)."""
        instance_id = command.instance_id
        with trace_context.sending(
            self.destination,
            instance_id,
            command.type,
            command.command_id,
            self._partition(instance_id),
        ) as (traceparent, tracestate):
            # Stamped when accepted: the owner measures its start's schedule-to-start
            # from it. In place (records are plain slotted classes at run time): the
            # command was made for this call and nothing else holds it, and a copy
            # (``dataclasses.replace``) cost about 1% of W1's whole start path.
            object.__setattr__(command, "time_ms", self._clock.now_ms())
            if traceparent is not None:
                object.__setattr__(command, "traceparent", traceparent)
                object.__setattr__(command, "tracestate", tracestate)
            settled = self._publishing.settled(instance_id, command.command_id)
            try:
                await self._publish(command)
                reason = await settled
            finally:
                self._publishing.forget(instance_id, command.command_id)
        if reason is not None:
            action = _ACTIONS.get(command.type, command.type)
            raise error_for(reason, command.instance_id, action)

    def _encode(self, value: Any, what: str) -> Any:
        return check_size(encode_safely(self._codec, value), self._limit, what=what)

    @abc.abstractmethod
    async def _check_exists(self, instance_id: str) -> None:
        """Raise ``UnknownInstance`` if the transport can tell cheaply that there is no
        such instance. Commands for finished instances are published all the same: the
        owner records them as ignored and settles them with the reason."""

    async def start(
        self,
        workflow: str,
        input: Any,
        instance_id: str,
        version: str | None = None,
        if_exists: str = "return",
        *,
        priority: int | None = None,
        queue_key: str | None = None,
    ) -> str:
        check_name(instance_id, "instance id")
        check_name(workflow, "workflow name")
        check_if_exists(if_exists)
        if version is not None:
            check_name(version, f"version of workflow {workflow!r}:")
        definition = self._publishing.resolve(workflow, version)
        reserved = reserved_id_problem(instance_id, definition.name)
        if reserved is not None:
            raise InvalidPayload(f"instance id {instance_id!r} {reserved}")
        scheduled = scheduled_workflow(definition.name, input)
        if scheduled is not None:
            self._publishing.resolve(scheduled)  # UnknownWorkflow, as its own start would
        payload = self._encode(input, f"input of instance {instance_id}")
        await self._submit(
            StartWorkflow(
                instance_id=instance_id,
                command_id=str(uuid.uuid4()),
                workflow=definition.name,
                version=definition.version,
                input=payload,
                if_exists=if_exists,
                priority=priority,
                queue_key=queue_key,
            )
        )
        return instance_id

    async def send_event(
        self, instance_id: str, name: str, payload: Any, event_id: str | None = None
    ) -> None:
        check_name(instance_id, "instance id")
        check_name(name, f"the name of an event for instance {instance_id}:", event_name_problem)
        if event_id is not None:
            check_name(event_id, "event id", event_id_problem)
        encoded = self._encode(payload, f"event {name!r} for instance {instance_id}")
        await self._check_exists(instance_id)
        await self._submit(
            SendEvent(
                instance_id=instance_id,
                command_id=event_id or str(uuid.uuid4()),
                name=name,
                payload=encoded,
            )
        )

    @abc.abstractmethod
    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        """The instance's answer to the event ``message_id`` (``msg.complete``);
        ``ResultTimeout`` if it gave none within ``timeout`` seconds."""

    async def cancel(self, instance_id: str, reason: str) -> None:
        _check_reason(instance_id, reason, "cancel")
        await self._check_exists(instance_id)
        await self._submit(
            CancelWorkflow(instance_id=instance_id, command_id=str(uuid.uuid4()), reason=reason)
        )

    async def terminate(self, instance_id: str, reason: str) -> None:
        _check_reason(instance_id, reason, "terminate")
        await self._check_exists(instance_id)
        await self._submit(
            TerminateWorkflow(instance_id=instance_id, command_id=str(uuid.uuid4()), reason=reason)
        )

    async def pause(self, instance_id: str) -> None:
        check_name(instance_id, "instance id")
        await self._check_exists(instance_id)
        await self._submit(PauseWorkflow(instance_id=instance_id, command_id=str(uuid.uuid4())))

    async def resume(self, instance_id: str) -> None:
        check_name(instance_id, "instance id")
        await self._check_exists(instance_id)
        await self._submit(ResumeWorkflow(instance_id=instance_id, command_id=str(uuid.uuid4())))

    async def reset(self, instance_id: str, to: str, reason: str) -> None:
        await self._check_exists(instance_id)
        await self._submit(
            ResetWorkflow(
                instance_id=instance_id, command_id=str(uuid.uuid4()), to=to, reason=reason
            )
        )

    async def retry(self, instance_id: str, reason: str) -> None:
        await self._check_exists(instance_id)
        await self._submit(
            RetryWorkflow(instance_id=instance_id, command_id=str(uuid.uuid4()), reason=reason)
        )

    async def fork(self, instance_id: str, to: str, new_id: str) -> str:
        await self._check_exists(instance_id)
        await self._submit(
            ForkWorkflow(
                instance_id=instance_id, command_id=str(uuid.uuid4()), to=to, new_id=new_id
            )
        )
        return new_id

    @abc.abstractmethod
    async def status(self, instance_id: str) -> InstanceStatus: ...

    @abc.abstractmethod
    async def result(self, instance_id: str, timeout: float | None) -> Any: ...

    @abc.abstractmethod
    async def history(self, instance_id: str) -> list[HistoryEntry]: ...

    @abc.abstractmethod
    async def list(self, status: str | None) -> list[InstanceStatus]: ...

    @abc.abstractmethod
    async def list_page(self, query: ListQuery) -> InstancePage: ...

    @abc.abstractmethod
    async def overview(self) -> Overview: ...

    async def close(self) -> None:
        if self._on_close is not None:
            await self._on_close()


def _check_reason(instance_id: str, reason: str, action: str) -> None:
    check_name(instance_id, "instance id")
    if not isinstance(reason, str):
        raise InvalidPayload(f"the {action} reason must be a string, not {type(reason).__name__}")
    problem = text_problem(reason)
    if problem is not None:
        raise InvalidPayload(f"the {action} reason for instance {instance_id} {problem}")
    if len(reason) > MAX_MESSAGE_CHARS:
        raise PayloadTooLarge(
            f"the {action} reason for instance {instance_id} is {len(reason)} characters, "
            f"over the limit of {MAX_MESSAGE_CHARS}; say it in fewer words"
        )


class LogTransport(CommandPublisher):
    """Commands published through ``publish``, reads from an in-process ``reader``."""

    def __init__(
        self,
        publish: Callable[[Command], Awaitable[None]],
        reader: Reader,
        *,
        codec: PayloadCodec,
        max_payload_bytes: int,
        on_close: Callable[[], Awaitable[None]] | None = None,
        clock: Clock | None = None,
        destination: trace_context.Destination = trace_context.IN_PROCESS,
    ) -> None:
        super().__init__(
            publish,
            reader,
            codec=codec,
            max_payload_bytes=max_payload_bytes,
            on_close=on_close,
            clock=clock,
        )
        self._reader = reader
        self.destination = destination  # a Kafka worker's API publishes to its topic

    async def _check_exists(self, instance_id: str) -> None:
        # Raises UnknownInstance. A command for a finished instance is published: the
        # processor records it as ignored and the publisher raises InstanceFinished.
        self._reader.finished(instance_id)

    async def status(self, instance_id: str) -> InstanceStatus:
        return InstanceStatus.of(self._reader.read_state(instance_id))

    async def result(self, instance_id: str, timeout: float | None) -> Any:
        try:
            state = await self._reader.wait_finished(instance_id, timeout)
        except TimeoutError:
            raise ResultTimeout(
                f"instance {instance_id} did not finish within {timeout} s; it is still "
                "running: check `stepstream status` and wait again"
            ) from None
        return raise_for_outcome(state, self._codec)

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        try:
            answer = await self._reader.wait_reply(instance_id, message_id, timeout)
        except TimeoutError:
            raise ResultTimeout(
                f"instance {instance_id} did not answer message {message_id} within {timeout} "
                "s; the message is queued there: wait again, or check `stepstream status`"
            ) from None
        return decode_safely(self._codec, answer)

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        records = self._reader.read_history(instance_id)
        return mark_set_aside([HistoryEntry.of(r, self._codec) for r in records])

    async def list(self, status: str | None) -> list[InstanceStatus]:
        states = self._reader.list_instances()
        views = [InstanceStatus.of(s) for s in states if status is None or s.status == status]
        return sorted(views, key=lambda v: (v.created_at, v.instance_id))

    async def list_page(self, query: ListQuery) -> InstancePage:
        if not query.by_id:
            # In one go: each owner reads its index by created time (a filter too rare
            # for that reads every meta: consumers.created_listing).
            return self._reader.list_page(query, _LIST_SLICE)
        # In slices of a bounded number of keys per partition, yielding between them, so
        # a filter that matches little never holds the processors up for long.
        found: list[InstanceStatus] = []
        after = query.after
        while True:
            page = self._reader.list_page(
                query.resumed(after, query.limit - len(found)), _LIST_SLICE
            )
            found.extend(page.instances)
            after = page.next
            if after is None or len(found) >= query.limit:
                return InstancePage(found, after)
            await asyncio.sleep(0)

    async def overview(self) -> Overview:
        # In slices, like list_page: counting every instance takes a while at 100,000.
        parts = []
        progress = None
        while True:
            part, progress = self._reader.overview_slice(progress, _LIST_SLICE)
            parts.append(part)
            if progress is None:
                return merge_overviews(parts)
            await asyncio.sleep(0)
