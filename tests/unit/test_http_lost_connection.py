"""An http:// client whose connection breaks under a call: a read is asked again and
answered, a command is not sent twice and says it may have been applied. The server is
a real one on loopback that drops the connection of the first two calls on each path
(aiohttp itself makes an idempotent request again once, when a connection it reused
turns out closed)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from stepstream import Client
from stepstream.errors import ConnectionFailed, ConnectionLost
from tests.http_site import served


@pytest.fixture
async def dropping() -> AsyncIterator[tuple[str, Counter[str]]]:
    """A server that drops the connection of the first two calls on each path, then
    answers."""
    calls: Counter[str] = Counter()

    async def handle(request: web.Request) -> web.Response:
        calls[request.path] += 1
        if calls[request.path] <= 2:
            assert request.transport is not None
            request.transport.close()
        return web.json_response({"instances": []})

    app = web.Application()
    app.router.add_get("/v1/instances", handle)
    app.router.add_post("/v1/instances/{id}/terminate", handle)
    async with served(app) as url:
        yield url, calls


async def test_a_read_whose_connection_broke_is_asked_again(
    dropping: tuple[str, Counter[str]],
) -> None:
    url, calls = dropping
    async with Client.connect(url) as client:
        assert await client.list() == []
    assert calls["/v1/instances"] == 3


async def test_a_command_whose_connection_broke_is_not_sent_again(
    dropping: tuple[str, Counter[str]],
) -> None:
    url, calls = dropping
    async with Client.connect(url) as client:
        with pytest.raises(ConnectionLost, match="may have been applied or not") as lost:
            await client.terminate("o-1", reason="test")
    assert isinstance(lost.value, ConnectionFailed)  # what callers already catch
    assert lost.value.retriable  # the CLI exits 4 for it
    assert calls["/v1/instances/o-1/terminate"] == 1
