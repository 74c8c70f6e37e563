"""The public API over every engine process: each call about an instance goes to the
process that owns it, listings and overviews are merged, and ``GET /v1/processes`` says
where each process serves its own partitions so a client can go there itself."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from stepstream.engine.reads.listing import (
    InstancePage,
    ListQuery,
    Overview,
    merge_overviews,
    merge_pages,
)
from stepstream.engine.reads.views import HistoryEntry, InstanceStatus
from stepstream.ops.processes.layout import ProcessLayout
from stepstream.producers.client import Transport
from stepstream.producers.http.security import client_headers
from stepstream.producers.http.transport import HttpTransport
from stepstream.producers.http.wire import PROCESSES_PATH, ServerUnavailable

T = TypeVar("T")
# How long a listing or an overview waits for each engine process.
EVERY_TIMEOUT_S = 20.0


class ProcessesTransport:
    """The API's transport in process 0: each call about an instance goes to the process
    that owns it (this one's own transport, or another's API session); listings and
    overviews are merged from all of them."""

    def __init__(
        self, local: Transport, layout: ProcessLayout, me: int, remotes: Mapping[int, Transport]
    ) -> None:
        self._layout = layout
        self._all: dict[int, Transport] = {me: local, **remotes}

    def _to(self, instance_id: str) -> Transport:
        return self._all[self._layout.process_of(instance_id)]

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
        to = self._to(instance_id)
        return await to.start(
            workflow,
            input,
            instance_id,
            version,
            if_exists,
            priority=priority,
            queue_key=queue_key,
        )

    async def send_event(
        self, instance_id: str, name: str, payload: Any, event_id: str | None = None
    ) -> None:
        await self._to(instance_id).send_event(instance_id, name, payload, event_id)

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        return await self._to(instance_id).reply(instance_id, message_id, timeout)

    async def terminate(self, instance_id: str, reason: str) -> None:
        await self._to(instance_id).terminate(instance_id, reason)

    async def cancel(self, instance_id: str, reason: str) -> None:
        await self._to(instance_id).cancel(instance_id, reason)

    async def pause(self, instance_id: str) -> None:
        await self._to(instance_id).pause(instance_id)

    async def resume(self, instance_id: str) -> None:
        await self._to(instance_id).resume(instance_id)

    async def reset(self, instance_id: str, to: str, reason: str) -> None:
        await self._to(instance_id).reset(instance_id, to, reason)

    async def retry(self, instance_id: str, reason: str) -> None:
        await self._to(instance_id).retry(instance_id, reason)

    async def fork(self, instance_id: str, to: str, new_id: str) -> str:
        return await self._to(instance_id).fork(instance_id, to, new_id)

    async def status(self, instance_id: str) -> InstanceStatus:
        return await self._to(instance_id).status(instance_id)

    async def result(self, instance_id: str, timeout: float | None) -> Any:
        return await self._to(instance_id).result(instance_id, timeout)

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        return await self._to(instance_id).history(instance_id)

    async def list(self, status: str | None) -> list[InstanceStatus]:
        answers = await self._every(lambda t: t.list(status))
        merged = [view for answer in answers for view in answer]
        return sorted(merged, key=lambda v: (v.created_at, v.instance_id))

    async def list_page(self, query: ListQuery) -> InstancePage:
        return merge_pages(await self._every(lambda t: t.list_page(query)), query.limit, query)

    async def overview(self) -> Overview:
        return merge_overviews(await self._every(lambda t: t.overview()))

    async def _every(self, call: Callable[[Transport], Awaitable[T]]) -> Sequence[T]:
        """``call`` on every process; ``ServerUnavailable`` naming the first that does not
        answer within ``EVERY_TIMEOUT_S`` (its socket is the parent's: a process that
        died or hangs does not refuse the call, it would wait in the backlog)."""

        async def one(process: int, transport: Transport) -> T:
            try:
                async with asyncio.timeout(EVERY_TIMEOUT_S):
                    return await call(transport)
            except TimeoutError:
                raise ServerUnavailable(
                    f"engine process {process} did not answer within {EVERY_TIMEOUT_S:g} s "
                    "(it died and is being started again, is still restoring, or hangs: "
                    "the server's log says which); ask again",
                    retry_after=EVERY_TIMEOUT_S,
                ) from None

        return await asyncio.gather(*(one(p, t) for p, t in self._all.items()))

    async def close(self) -> None:
        for transport in self._all.values():
            await transport.close()


def remote_transport(url: str, token: str) -> HttpTransport:
    """Another process's API, as its ``http://`` client sees it."""
    session = aiohttp.ClientSession(
        headers=client_headers(token), connector=aiohttp.TCPConnector(limit=64)
    )
    return HttpTransport(url, session)


def add_processes_route(app: web.Application, layout: ProcessLayout, ports: Sequence[int]) -> None:
    """``GET /v1/processes``: where each process serves its own partitions' API, so a
    client can send each instance's calls straight to its owner
    (``producers/http/routing.py``)."""
    answer = {
        "partitions": layout.partitions,
        "processes": [{"process": g, "port": port} for g, port in enumerate(ports)],
    }

    async def processes(request: web.Request) -> web.Response:
        return web.json_response(answer)

    app.router.add_get(PROCESSES_PATH, processes)
