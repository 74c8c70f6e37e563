"""What a Kafka worker answers for over its API: reads and waits of the instances on the
partitions it owns now. Others are refused with ``ConnectionFailed`` (HTTP 503): their
owner is elsewhere, and a ``kafka://`` client asks again there."""

from __future__ import annotations

import asyncio

from stepstream.consumers.host import OverviewProgress, PartitionHost
from stepstream.engine.api.workflow import WorkflowDefinition
from stepstream.engine.errors import ConnectionFailed, ResultTimeout
from stepstream.engine.reads.listing import InstancePage, ListQuery, Overview
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.wire.records import HistoryRecord, Payload
from stepstream.engine.wire.topics import partition_for


class OwnedReader:
    """The host's reads, refused (``ConnectionFailed``, HTTP 503) for an instance whose
    partition this worker does not own now: its owner is elsewhere, and a kafka:// client
    asks again there."""

    def __init__(self, host: PartitionHost) -> None:
        self._host = host

    def _check(self, instance_id: str) -> None:
        if not self._host.owns(instance_id):
            partition = partition_for(instance_id, self._host.partitions)
            raise ConnectionFailed(
                f"instance {instance_id} is on partition {partition}, which this worker does "
                "not own now; its owner is announced on the members topic (a kafka:// "
                "client finds it)"
            )

    def resolve(self, workflow: str, version: str | None = None) -> WorkflowDefinition:
        return self._host.resolve(workflow, version)

    def settled(self, instance_id: str, command_id: str) -> asyncio.Future[str | None]:
        return self._host.settled(instance_id, command_id)

    def forget(self, instance_id: str, command_id: str) -> None:
        self._host.forget(instance_id, command_id)

    def finished(self, instance_id: str) -> bool:
        self._check(instance_id)
        return self._host.finished(instance_id)

    def read_state(self, instance_id: str, *, entries: bool = True) -> InstanceState:
        self._check(instance_id)
        return self._host.read_state(instance_id, entries=entries)

    def read_history(self, instance_id: str) -> list[HistoryRecord]:
        self._check(instance_id)
        return self._host.read_history(instance_id)

    def list_instances(self) -> list[InstanceState]:
        return self._host.list_instances()

    def list_page(self, query: ListQuery, budget: int) -> InstancePage:
        return self._host.list_page(query, budget)

    def overview_slice(
        self, progress: OverviewProgress | None, budget: int
    ) -> tuple[Overview, OverviewProgress | None]:
        return self._host.overview_slice(progress, budget)

    async def wait_finished(self, instance_id: str, timeout: float | None) -> InstanceState:
        self._check(instance_id)
        return await self._host.wait_finished(instance_id, timeout)

    async def wait_reply(self, instance_id: str, message_id: str, timeout: float | None) -> Payload:
        self._check(instance_id)
        return await self._host.wait_reply(instance_id, message_id, timeout)

    def finished_status(self, instance_id: str) -> str | None:
        self._check(instance_id)
        if not self._host.finished(instance_id):
            return None
        return self._host.read_state(instance_id, entries=False).status.value

    async def wait_after(
        self, instance_id: str, command_id: str | None, offset: int | None, timeout: float | None
    ) -> str | None:
        """What became of a start the client published (``command_id``, at ``offset`` of
        the commands topic partition), once this owner has got that far: None (applied),
        the reason it was recorded and ignored, or why it was refused. With an offset
        alone, only waits for the owner to get that far."""
        self._check(instance_id)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if offset is not None:
            try:
                await self._host.wait_consumed(instance_id, offset, timeout)
            except TimeoutError:
                raise ResultTimeout(
                    f"instance {instance_id}: its owner had not yet applied the commands "
                    f"sent before this read within {timeout} s (a backlog); ask again"
                ) from None
        if command_id is None:
            return None
        if offset is None:  # the owner cannot tell whether it is past it: wait for it
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            return await self.wait_settled(command_id, instance_id, remaining)
        found, reason = self._host.settled_recently(instance_id, command_id)
        if found:
            return reason
        applied, reason = self._host.settled_before(instance_id, command_id)
        if applied:
            return reason
        # Past it, and it left no trace on the instance: refused, longer ago than this
        # owner remembers why.
        return (
            f"the start of instance {instance_id} (command {command_id}) was refused; "
            "its record on the dead-letters topic says why"
        )

    async def wait_settled(
        self, command_id: str, instance_id: str, timeout: float | None
    ) -> str | None:
        settled = self._host.settled(instance_id, command_id)
        try:
            if not settled.done():
                self._check(instance_id)
                # Settled before this worker took the partition over? The instance
                # keeps the ids of the commands applied to it, and their history.
                applied, reason = self._host.settled_before(instance_id, command_id)
                if applied:
                    return reason
            return await asyncio.wait_for(asyncio.shield(settled), timeout)
        except TimeoutError:
            raise ResultTimeout(
                f"command {command_id} was not settled within {timeout} s"
            ) from None
        finally:
            self._host.forget(instance_id, command_id)
