"""``kafka://HOST:PORT[,HOST:PORT...]?prefix=P``: a client that needs nothing but the
bootstrap servers.

Commands are checked here (``CommandPublisher``: encodable and small enough payloads, a
workflow some worker registered on ``<prefix>.definitions``), then published to
``<prefix>.commands`` with aiokafka (acks=all; not idempotent: its InitProducerId fails
against some brokers), on the instance's partition. Once the broker has acknowledged a
command it is durable, and no live worker is needed. A start returns then; the client's
next read of the instance names it (``after``), so the owner answers once it has applied
it. For the other commands, if the partition's owner is live the client waits a little
(``command_timeout``) to hear whether it applied the command, so it can report one it
refused (an unknown or finished instance); with no owner, or past that time, the call
returns and the command runs when a worker owns the partition.

Reads go to the worker that owns the instance's partition (``producers.kafka.routing``),
found on ``<prefix>.members``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from aiokafka.errors import KafkaError

from stepstream.engine.api.schedule_spec import scheduled_workflow
from stepstream.engine.errors import (
    ConnectionFailed,
    ResultTimeout,
    StepstreamError,
    UnknownInstance,
    UnknownWorkflow,
)
from stepstream.engine.reads.listing import InstancePage, ListQuery, Overview
from stepstream.engine.reads.views import HistoryEntry, InstanceStatus
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.engine.wire.records import Command, StartWorkflow
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.settle import settled_key
from stepstream.engine.wire.topics import TopicNames, partition_for
from stepstream.producers import trace_context
from stepstream.producers.http.transport import DEFAULT_REQUEST_TIMEOUT_S
from stepstream.producers.kafka.definitions import DefinitionsView, RemoteWorkflow
from stepstream.producers.kafka.members import MembersView
from stepstream.producers.kafka.routing import Router
from stepstream.producers.kafka.session import After, WorkerSession
from stepstream.producers.publisher import CommandPublisher

log = logging.getLogger("stepstream.kafka.client")
T = TypeVar("T")

# How long a command waits for a live owner to say whether it applied it.
DEFAULT_COMMAND_TIMEOUT_S = 5.0
_UNCONFIRMED_KEPT = 10_000  # the newest starts a result may have to wait for


class _Settlements:
    """``Publishing`` for ``CommandPublisher``: workflows from the definitions topic, and
    the futures that the publish step resolves once the command is published (and settled,
    if its owner was live to say so)."""

    def __init__(self, definitions: DefinitionsView) -> None:
        self._definitions = definitions
        self._waiting: dict[str, asyncio.Future[str | None]] = {}

    def resolve(self, workflow: str, version: str | None = None) -> RemoteWorkflow:
        return self._definitions.resolve(workflow, version)

    def settled(self, instance_id: str, command_id: str) -> asyncio.Future[str | None]:
        key = settled_key(instance_id, command_id)
        fut = self._waiting.get(key)
        if fut is None:
            fut = self._waiting[key] = asyncio.get_running_loop().create_future()
        return fut

    def forget(self, instance_id: str, command_id: str) -> None:
        self._waiting.pop(settled_key(instance_id, command_id), None)

    def settle(self, instance_id: str, command_id: str, reason: str | None) -> None:
        fut = self._waiting.get(settled_key(instance_id, command_id))
        if fut is not None and not fut.done():
            fut.set_result(reason)


class KafkaTransport(CommandPublisher):
    def __init__(
        self,
        *,
        producer: Any,
        members: MembersView,
        definitions: DefinitionsView,
        session: aiohttp.ClientSession,
        topics: TopicNames,
        partitions: int,
        codec: PayloadCodec,
        serde: RecordSerde,
        max_payload_bytes: int,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
    ) -> None:
        self._settlements = _Settlements(definitions)
        super().__init__(
            self._produce, self._settlements, codec=codec, max_payload_bytes=max_payload_bytes
        )
        self._producer = producer
        self.destination = trace_context.Destination("kafka", topics.commands)
        self._members = members
        self._definitions = definitions
        self._topics = topics
        self._partitions = partitions
        self._serde = serde
        self._request_timeout = request_timeout
        self._command_timeout = command_timeout
        self._router = Router(members, session, topics, partitions, request_timeout)
        # Starts published here that no read has seen applied yet, by instance: their
        # command id and offset. A read names its instance's start, and the owner answers
        # once it has got past it (it may still be working through a backlog).
        self._unconfirmed: dict[str, After] = {}
        # Per partition, the offset of the last start published here: a read of an
        # instance started longer ago than the starts kept waits for the owner to get
        # past that, rather than hear of no such instance.
        self._latest: dict[int, int] = {}

    # ---- commands -----------------------------------------------------------------------

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
        definitions = self._definitions
        scheduled = scheduled_workflow(workflow, input)
        if not definitions.knows(workflow, version) or (
            scheduled is not None and not definitions.knows(scheduled, None)
        ):
            await definitions.synced(self._request_timeout)  # registered a moment ago?
            # A fresh prefix: the first worker is starting (a script runs `stepstream
            # worker &` and then `stepstream start`), give it the time to register.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._request_timeout
            while definitions.empty and loop.time() < deadline:
                await definitions.changed(deadline - loop.time())
            if definitions.empty:
                raise UnknownWorkflow(
                    f"unknown workflow {workflow!r}: no worker of prefix "
                    f"{self._topics.prefix!r} has ever registered a workflow, and none did "
                    f"within {self._request_timeout:g} s; start one with `stepstream worker "
                    "--workflows MODULE ...` (once it has registered, starts are accepted "
                    "even while no worker runs)"
                )
        return await super().start(
            workflow,
            input,
            instance_id,
            version,
            if_exists,
            priority=priority,
            queue_key=queue_key,
        )

    async def _produce(self, command: Command) -> None:
        partition = self._partition(command.instance_id)
        try:
            landed = await self._producer.send_and_wait(
                self._topics.commands,
                self._serde.encode(command),
                key=command.instance_id.encode(),
                partition=partition,
                headers=trace_context.record_headers(command.traceparent, command.tracestate),
            )
        except KafkaError as exc:
            raise ConnectionFailed(
                f"cannot publish {command.type} for instance {command.instance_id} to "
                f"{self._topics.commands}: {exc}; check the brokers, then retry"
            ) from None

        if isinstance(command, StartWorkflow):
            # Durable now, and a start returns (design: never wait for a worker). Its
            # owner applies it when it gets to it; a read of the instance from this
            # client names it (``after``) so that the owner answers once it has.
            self._unconfirmed.pop(command.instance_id, None)  # the newest go last
            self._unconfirmed[command.instance_id] = (command.command_id, landed.offset)
            if len(self._unconfirmed) > _UNCONFIRMED_KEPT:
                del self._unconfirmed[next(iter(self._unconfirmed))]
            self._latest[partition] = max(landed.offset, self._latest.get(partition, -1))
            if command.if_exists != "fail":
                self._settlements.settle(command.instance_id, command.command_id, None)
                return
            # if_exists="fail": the owner decides against the state it owns, so its
            # answer is awaited as a cancel's is (InstanceExists).

        # Durable now. A live owner says soon whether it applied or refused the command
        # (an unknown or finished instance); without one, or if it takes longer, the
        # command runs when a worker gets to it.
        reason = None
        if self._members.owner(partition) is not None:

            async def ask(api: WorkerSession, remaining: float | None) -> str | None:
                assert remaining is not None
                return await api.settled(command.command_id, command.instance_id, remaining)

            try:
                reason = await self._router.routed(
                    partition,
                    ask,
                    self._command_timeout,
                    f"{command.type} for {command.instance_id}",
                )
            except (ConnectionFailed, ResultTimeout) as exc:
                log.info(
                    "%s for instance %s is published; its owner did not confirm it within "
                    "%s s (%s): it runs when a worker gets to it",
                    command.type,
                    command.instance_id,
                    self._command_timeout,
                    exc,
                )
        self._settlements.settle(command.instance_id, command.command_id, reason)

    async def _check_exists(self, instance_id: str) -> None:
        """No round trip before publishing (the owner may be down): a live owner settles a
        command for an unknown instance as a dead letter (UnknownInstance) and one for a
        finished instance as recorded and ignored (InstanceFinished), and ``_submit``
        raises either; with no live owner the command is dead-lettered or ignored later."""

    # ---- reads ----------------------------------------------------------------------------

    async def status(self, instance_id: str) -> InstanceStatus:
        async def ask(api: WorkerSession, remaining: float | None) -> InstanceStatus:
            return await self._after_starts(
                instance_id, lambda after: api.status(instance_id, after)
            )

        return await self._router.routed(
            self._partition(instance_id), ask, self._request_timeout, f"status of {instance_id}"
        )

    async def result(self, instance_id: str, timeout: float | None) -> Any:
        async def ask(api: WorkerSession, remaining: float | None) -> Any:
            return await self._after_starts(
                instance_id, lambda after: api.result(instance_id, remaining, after)
            )

        def expired() -> ResultTimeout:
            return ResultTimeout(
                f"instance {instance_id} did not finish within {timeout} s; it is still "
                "running: check `stepstream status` and wait again"
            )

        return await self._router.routed(
            self._partition(instance_id),
            ask,
            timeout,
            f"result of {instance_id}",
            expired,
            wait_for_owner=True,
        )

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        async def ask(api: WorkerSession, remaining: float | None) -> Any:
            return await api.reply(instance_id, message_id, remaining)

        def expired() -> ResultTimeout:
            return ResultTimeout(
                f"instance {instance_id} did not answer message {message_id} within {timeout} "
                "s; the message is queued there: wait again, or check `stepstream status`"
            )

        return await self._router.routed(
            self._partition(instance_id),
            ask,
            timeout,
            f"reply of {instance_id}",
            expired,
            wait_for_owner=True,
        )

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        async def ask(api: WorkerSession, remaining: float | None) -> list[HistoryEntry]:
            return await self._after_starts(
                instance_id, lambda after: api.history(instance_id, after)
            )

        return await self._router.routed(
            self._partition(instance_id), ask, self._request_timeout, f"history of {instance_id}"
        )

    async def _after_starts(
        self, instance_id: str, read: Callable[[After | None], Awaitable[T]]
    ) -> T:
        """``read`` the instance after this client's start of it (if it keeps one)."""
        start = self._unconfirmed.get(instance_id)
        try:
            value = await read(start)
        except UnknownInstance:
            latest = self._latest.get(self._partition(instance_id))
            if start is not None or latest is None:
                raise
            # Started here, maybe, longer ago than the starts kept: ask again once the
            # owner has got past every start this client published on the partition.
            value = await read((None, latest))
        except (ConnectionFailed, ResultTimeout):
            raise  # asked again, of this owner or the next
        except StepstreamError:
            self._confirmed(instance_id, start)  # past the start: refused, or a failed run
            raise
        self._confirmed(instance_id, start)
        return value

    def _confirmed(self, instance_id: str, start: After | None) -> None:
        """The owner answered a read made after ``start``: the start is behind it."""
        if start is not None and self._unconfirmed.get(instance_id) == start:
            del self._unconfirmed[instance_id]

    async def list(self, status: str | None) -> list[InstanceStatus]:
        return await self._router.list(status)

    async def list_page(self, query: ListQuery) -> InstancePage:
        return await self._router.list_page(query)

    async def overview(self) -> Overview:
        return await self._router.overview()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._producer.stop()
        await self._members.close()
        await self._definitions.close()
        await self._router.close()

    def _partition(self, instance_id: str) -> int:
        return partition_for(instance_id, self._partitions)
