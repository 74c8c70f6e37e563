"""The log transport: a client that publishes commands to the commands log itself and
reads from the partitions' owner. Used in-process by the embedded backend and, with a
remote reader, by Kafka clients. Input is checked here, before anything is published."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from engine.codec import PayloadCodec, check_size
from engine.errors import (
    InstanceFinished,
    ResultTimeout,
    StepstreamError,
    UnknownInstance,
    UnknownWorkflow,
    WorkflowCancelled,
    WorkflowFailed,
)
from engine.records import (
    CancelWorkflow,
    Command,
    HistoryRecord,
    PauseWorkflow,
    ResumeWorkflow,
    SendEvent,
    StartWorkflow,
)
from engine.state import InstanceState, Status
from engine.views import HistoryEntry, InstanceStatus
from engine.workflow import WorkflowDefinition


class Reader(Protocol):
    def resolve(self, workflow: str) -> WorkflowDefinition: ...

    def settled(self, command_id: str) -> asyncio.Future[str | None]: ...

    def forget(self, command_id: str) -> None: ...

    def finished(self, instance_id: str) -> bool: ...

    def read_state(self, instance_id: str, *, entries: bool = True) -> InstanceState: ...

    def read_history(self, instance_id: str) -> list[HistoryRecord]: ...

    def list_instances(self) -> list[InstanceState]: ...

    async def wait_finished(self, instance_id: str, timeout: float | None) -> InstanceState: ...


def raise_for_outcome(state: InstanceState, codec: PayloadCodec) -> Any:
    """The result of a finished instance, or the error that describes how it ended."""
    if state.status is Status.COMPLETED:
        assert state.result is not None
        return codec.decode(state.result)
    if state.status is Status.CANCELLED:
        raise WorkflowCancelled(
            f"instance {state.instance_id} was cancelled: {state.cancel_reason or 'no reason'}",
            instance_id=state.instance_id,
            reason=state.cancel_reason,
        )
    raise WorkflowFailed(
        f"instance {state.instance_id} failed: {state.error_type}: {state.error_message}",
        instance_id=state.instance_id,
        error_type=state.error_type,
    )


class LogTransport:
    def __init__(
        self,
        publish: Callable[[Command], Awaitable[None]],
        reader: Reader,
        *,
        codec: PayloadCodec,
        max_payload_bytes: int,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._publish = publish
        self._reader = reader
        self._codec = codec
        self._limit = max_payload_bytes
        self._on_close = on_close

    async def _submit(self, command: Command) -> None:
        settled = self._reader.settled(command.command_id)
        try:
            await self._publish(command)
            reason = await settled
        finally:
            self._reader.forget(command.command_id)
        if reason is not None:
            if reason.startswith("unknown instance"):
                raise UnknownInstance(reason)
            if reason.startswith("unknown workflow"):
                raise UnknownWorkflow(reason)
            raise StepstreamError(f"command rejected and sent to dead-letters: {reason}")

    def _encode(self, value: Any, what: str) -> Any:
        return check_size(self._codec.encode(value), self._limit, what=what)

    def _live(self, instance_id: str, action: str) -> None:
        if self._reader.finished(instance_id):
            status = self._reader.read_state(instance_id, entries=False).status.value
            raise InstanceFinished(
                f"instance {instance_id} is already {status}; {action} has no "
                "effect on a finished instance (start a new instance instead)"
            )

    async def start(self, workflow: str, input: Any, instance_id: str) -> str:
        definition = self._reader.resolve(workflow)
        payload = self._encode(input, f"input of instance {instance_id}")
        await self._submit(
            StartWorkflow(
                instance_id=instance_id,
                command_id=str(uuid.uuid4()),
                workflow=definition.name,
                version=definition.version,
                input=payload,
            )
        )
        return instance_id

    async def send_event(self, instance_id: str, name: str, payload: Any) -> None:
        encoded = self._encode(payload, f"event {name!r} for instance {instance_id}")
        self._live(instance_id, "sending an event")
        await self._submit(
            SendEvent(
                instance_id=instance_id, command_id=str(uuid.uuid4()), name=name, payload=encoded
            )
        )

    async def cancel(self, instance_id: str, reason: str) -> None:
        self._live(instance_id, "cancel")
        await self._submit(
            CancelWorkflow(instance_id=instance_id, command_id=str(uuid.uuid4()), reason=reason)
        )

    async def pause(self, instance_id: str) -> None:
        self._live(instance_id, "pause")
        await self._submit(PauseWorkflow(instance_id=instance_id, command_id=str(uuid.uuid4())))

    async def resume(self, instance_id: str) -> None:
        self._live(instance_id, "resume")
        await self._submit(ResumeWorkflow(instance_id=instance_id, command_id=str(uuid.uuid4())))

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

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        return [HistoryEntry.of(r, self._codec) for r in self._reader.read_history(instance_id)]

    async def list(self, status: str | None) -> list[InstanceStatus]:
        states = self._reader.list_instances()
        views = [InstanceStatus.of(s) for s in states if status is None or s.status == status]
        return sorted(views, key=lambda v: (v.created_at, v.instance_id))

    async def close(self) -> None:
        if self._on_close is not None:
            await self._on_close()
