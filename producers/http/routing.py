"""The ``http://`` client against ``stepstream dev --processes N``: each instance's calls
go straight to the engine process that owns it.

The server says, at ``GET /v1/processes``, how many partitions there are and on which
port each process serves the API of its own partitions (the same host, scheme, token
and TLS as the server's). Once the client has that, a start, a command, a read or a
wait for an instance goes to its owner, whose API session it keeps open; listings and
overviews still go to the server, which merges them. Against a server with one process
(or one that does not know the route), or when the processes' own ports cannot be
reached (a firewall that lets only the server's port through), every call goes to the
server, which passes each one on to the owner itself.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from yarl import URL

from stepstream.engine.errors import StepstreamError
from stepstream.engine.reads.listing import InstancePage, ListQuery, Overview
from stepstream.engine.reads.views import HistoryEntry, InstanceStatus
from stepstream.engine.wire.topics import partition_for
from stepstream.producers.http.transport import HttpTransport
from stepstream.producers.http.wire import PROCESSES_PATH

log = logging.getLogger("stepstream.client")

_DISCOVERY_TIMEOUT_S = 5.0  # for the list, and for the processes' ports to answer


class RoutedHttpTransport:
    """An ``HttpTransport`` to the server, and one to each of its other engine processes
    once it has said where they are."""

    def __init__(self, server: Any) -> None:
        self._server = server  # an HttpTransport
        self._owners: list[Any] | None = None  # by process; None until asked
        self._partitions = 0
        self._asking = asyncio.Lock()

    async def _to(self, instance_id: str) -> Any:
        owners = self._owners
        if owners is None:
            owners = await self._discover()
        if len(owners) == 1:
            return owners[0]
        return owners[partition_for(instance_id, self._partitions) % len(owners)]

    async def _discover(self) -> list[Any]:
        async with self._asking:
            if self._owners is not None:
                return self._owners
            server = self._server
            owners = [server]
            layout = await _processes(server.http, server.base_url)
            if layout is not None:
                partitions, ports = layout
                others = [_sibling(server, port) for port in ports[1:]]
                try:
                    async with asyncio.timeout(_DISCOVERY_TIMEOUT_S):
                        for other in others:
                            await other.probe()
                except (StepstreamError, TimeoutError) as exc:
                    log.info(
                        "the engine processes' own ports are not reachable (%s); calls go "
                        "through %s, which passes them on",
                        exc or "no answer in time",
                        server.base_url,
                    )
                    for other in others:
                        await other.close_session_only()
                else:
                    owners += others
                    self._partitions = partitions
            self._owners = owners
            return owners

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
        to = await self._to(instance_id)
        return str(
            await to.start(
                workflow,
                input,
                instance_id,
                version,
                if_exists,
                priority=priority,
                queue_key=queue_key,
            )
        )

    async def send_event(
        self, instance_id: str, name: str, payload: Any, event_id: str | None = None
    ) -> None:
        await (await self._to(instance_id)).send_event(instance_id, name, payload, event_id)

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        return await (await self._to(instance_id)).reply(instance_id, message_id, timeout)

    async def cancel(self, instance_id: str, reason: str) -> None:
        await (await self._to(instance_id)).cancel(instance_id, reason)

    async def terminate(self, instance_id: str, reason: str) -> None:
        await (await self._to(instance_id)).terminate(instance_id, reason)

    async def pause(self, instance_id: str) -> None:
        await (await self._to(instance_id)).pause(instance_id)

    async def resume(self, instance_id: str) -> None:
        await (await self._to(instance_id)).resume(instance_id)

    async def reset(self, instance_id: str, to: str, reason: str) -> None:
        await (await self._to(instance_id)).reset(instance_id, to, reason)

    async def retry(self, instance_id: str, reason: str) -> None:
        await (await self._to(instance_id)).retry(instance_id, reason)

    async def fork(self, instance_id: str, to: str, new_id: str) -> str:
        forked: str = await (await self._to(instance_id)).fork(instance_id, to, new_id)
        return forked

    async def status(self, instance_id: str) -> InstanceStatus:
        status: InstanceStatus = await (await self._to(instance_id)).status(instance_id)
        return status

    async def result(self, instance_id: str, timeout: float | None) -> Any:
        return await (await self._to(instance_id)).result(instance_id, timeout)

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        entries: list[HistoryEntry] = await (await self._to(instance_id)).history(instance_id)
        return entries

    async def list(self, status: str | None) -> list[InstanceStatus]:
        views: list[InstanceStatus] = await self._server.list(status)
        return views

    async def list_page(self, query: ListQuery) -> InstancePage:
        page: InstancePage = await self._server.list_page(query)
        return page

    async def overview(self) -> Overview:
        overview: Overview = await self._server.overview()
        return overview

    async def close(self) -> None:
        for owner in (self._owners or [])[1:]:
            await owner.close_session_only()
        await self._server.close()


async def _processes(http: aiohttp.ClientSession, base_url: str) -> tuple[int, list[int]] | None:
    """(partitions, each process's port) from the server, or None when it runs one."""
    try:
        async with http.get(
            base_url + PROCESSES_PATH, timeout=aiohttp.ClientTimeout(total=_DISCOVERY_TIMEOUT_S)
        ) as response:
            if response.status != 200:
                return None  # one process, or a server from before the route
            answer = await response.json()
        partitions = int(answer["partitions"])
        ports = [int(p["port"]) for p in answer["processes"]]
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
        return None  # the calls themselves will say what is wrong with the server
    return (partitions, ports) if len(ports) > 1 and partitions > 0 else None


def _sibling(server: Any, port: int) -> Any:
    """An ``HttpTransport`` to the same host on ``port``, sharing the connection pool."""
    url = str(URL(server.base_url).with_port(port))
    return HttpTransport(url, server.http, request_timeout=server.request_timeout)
