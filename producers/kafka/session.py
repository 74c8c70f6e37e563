"""One worker's API as a ``kafka://`` client sees it: reads and waits as calls on the
worker's session websocket (many in flight, batched both ways), listing over plain HTTP.
The HTTP session underneath is shared by every worker's API (see ``producers.http.session``)."""

from __future__ import annotations

from typing import Any

from stepstream.engine.reads.views import HistoryEntry, InstanceStatus
from stepstream.producers.http.transport import HttpTransport

# A start a client published: its command id (None: any start up to the offset) and the
# offset the broker gave it on the commands topic.
After = tuple[str | None, int]


class WorkerSession(HttpTransport):
    """The calls a ``kafka://`` client makes of the worker that owns a partition."""

    NOT_LISTENING_ADVICE = "no worker listens there ({reason})"
    LOST_RETRIES = 0  # the router asks the partition's next owner itself, at once

    async def settled(self, command_id: str, instance_id: str, timeout: float | None) -> str | None:
        reason = await self._calls.call(
            "settled", command_id=command_id, instance_id=instance_id, timeout=timeout
        )
        return None if reason is None else str(reason)

    async def finished_status(self, instance_id: str) -> str | None:
        """The status of a finished instance, or None (raises ``UnknownInstance``)."""
        status = await self._calls.call("finished", instance_id=instance_id)
        return None if status is None else str(status)

    # ``after``: a start this client published that the owner may not have applied yet
    # (its command id, or None, and its offset); the owner answers once it has got past
    # it (a read of an instance must not race its own start).

    async def status(self, instance_id: str, after: After | None = None) -> InstanceStatus:
        raw = await self._read("status", instance_id, after)
        return InstanceStatus.from_json(raw)

    async def history(self, instance_id: str, after: After | None = None) -> list[HistoryEntry]:
        raw = await self._read("history", instance_id, after)
        return [HistoryEntry.from_json(entry) for entry in raw]

    async def result(
        self, instance_id: str, timeout: float | None, after: After | None = None
    ) -> Any:
        return await self._read("result", instance_id, after, timeout=timeout)

    async def _read(self, op: str, instance_id: str, after: After | None, **args: Any) -> Any:
        if after is not None:
            command_id, args["after_offset"] = after
            if command_id is not None:
                args["after"] = command_id
        return await self._calls.call(op, instance_id=instance_id, **args)

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        return await self._calls.call(
            "reply", instance_id=instance_id, message_id=message_id, timeout=timeout
        )

    async def close(self) -> None:
        # The HTTP session is the transport's, shared by every worker's API.
        await self._calls.close()
