"""One worker's API as a ``kafka://`` client sees it: reads and waits as calls on the
worker's session websocket (many in flight, batched both ways), listing over plain HTTP.
The HTTP session underneath is shared by every worker's API (see ``producers.http``)."""

from __future__ import annotations

from typing import Any

from engine.views import HistoryEntry, InstanceStatus
from producers.http import HttpTransport


class WorkerSession(HttpTransport):
    """The calls a ``kafka://`` client makes of the worker that owns a partition."""

    async def settled(self, command_id: str, instance_id: str, timeout: float | None) -> str | None:
        reason = await self._calls.call(
            "settled", command_id=command_id, instance_id=instance_id, timeout=timeout
        )
        return None if reason is None else str(reason)

    async def finished_status(self, instance_id: str) -> str | None:
        """The status of a finished instance, or None (raises ``UnknownInstance``)."""
        status = await self._calls.call("finished", instance_id=instance_id)
        return None if status is None else str(status)

    async def status(self, instance_id: str) -> InstanceStatus:
        return InstanceStatus.from_json(await self._calls.call("status", instance_id=instance_id))

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        raw = await self._calls.call("history", instance_id=instance_id)
        return [HistoryEntry.from_json(entry) for entry in raw]

    async def result(self, instance_id: str, timeout: float | None) -> Any:
        return await self._calls.call("result", instance_id=instance_id, timeout=timeout)

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        return await self._calls.call(
            "reply", instance_id=instance_id, message_id=message_id, timeout=timeout
        )

    async def close(self) -> None:
        # The HTTP session is the transport's, shared by every worker's API.
        await self._calls.close()
