"""Forwarding between engine processes: the commands one process's instances send to
another's instances (a child's start, a message, a parent's notice) go to their owner
over its internal API, exactly once (``consumers/embedded/forwarding``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web

from stepstream.consumers.embedded.forwarding import (
    Entries,
    Forwarder,
    ForwardReceiver,
    decode_batch,
    encode_batch,
)
from stepstream.engine.errors import StepstreamError
from stepstream.ops.api.security import INTERNAL_PREFIX, RECORDS_TYPE
from stepstream.ops.embedded import EmbeddedEngine
from stepstream.ops.processes.layout import ProcessLayout
from stepstream.producers.http.security import client_headers

FORWARD_PATH = INTERNAL_PREFIX + "v1/forward"


def add_forward_routes(app: web.Application, receiver: ForwardReceiver) -> None:
    """The owner's side of forwarding, on an app whose guard checks the processes' token."""

    async def position(request: web.Request) -> web.Response:
        try:
            source = int(request.query["source"])
            partition = int(request.query["partition"])
            return web.json_response({"next": receiver.position(source, partition)})
        except (KeyError, ValueError) as exc:
            return web.json_response(
                {"error": f"bad forwarding position request: {exc}"}, status=400
            )

    async def receive(request: web.Request) -> web.Response:
        try:
            source, partition, first, entries = decode_batch(await request.read())
            following = await receiver.receive(source, partition, first, entries)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        return web.json_response({"next": following})

    app.router.add_get(FORWARD_PATH, position)
    app.router.add_post(FORWARD_PATH, receive)


class ForwardClient:
    """The source's side of forwarding: asks the owners over HTTP."""

    def __init__(self, me: int, layout: ProcessLayout, urls: Sequence[str], token: str) -> None:
        self._me = me
        self._layout = layout
        self._urls = urls
        self._http = aiohttp.ClientSession(
            headers=client_headers(token), timeout=aiohttp.ClientTimeout(total=30)
        )

    def _url(self, partition: int) -> str:
        return self._urls[self._layout.owner(partition)] + FORWARD_PATH

    async def position(self, partition: int) -> int:
        params = {"source": str(self._me), "partition": str(partition)}
        async with self._http.get(self._url(partition), params=params) as response:
            return await _next_offset(response)

    async def send(self, partition: int, first: int, entries: Entries) -> int:
        body = encode_batch(self._me, partition, first, entries)
        headers = {"Content-Type": RECORDS_TYPE}
        async with self._http.post(self._url(partition), data=body, headers=headers) as response:
            return await _next_offset(response)

    async def close(self) -> None:
        await self._http.close()


async def _next_offset(response: aiohttp.ClientResponse) -> int:
    answer = await response.json(content_type=None)
    if response.status != 200:
        raise StepstreamError(f"HTTP {response.status}: {answer.get('error', answer)}")
    return int(answer["next"])


@contextlib.asynccontextmanager
async def forwarding(
    engine: EmbeddedEngine, layout: ProcessLayout, me: int, urls: Sequence[str], token: str
) -> AsyncIterator[ForwardReceiver]:
    """The receiver of this process's partitions and the forwarder of the others'."""
    receiver = ForwardReceiver(engine.db, layout.partitions_of(me))
    client = ForwardClient(me, layout, urls, token)
    forwarder = Forwarder(engine.db, layout.others(me), client.send, client.position)
    forwarder.start()
    try:
        yield receiver
    finally:
        await forwarder.close()
        await client.close()
