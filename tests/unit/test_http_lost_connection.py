"""An http:// client whose connection breaks under a call: a read or a wait is asked
again and answered, a command is never sent twice and says it may have been applied, a
server that drops every connection is given up on at once, and closing the client ends
its waits. The servers are real ones on loopback."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from stepstream import Client
from stepstream.errors import ConnectionFailed, ConnectionLost
from stepstream.producers.http.wire import error_from_wire, error_to_wire
from tests.http_site import served

Calls = Counter[str]


def _drop(request: web.Request) -> None:
    assert request.transport is not None
    request.transport.close()


@pytest.fixture
async def dropping() -> AsyncIterator[tuple[str, Calls]]:
    """A server that drops the connection of the first two calls on each path, then
    answers (aiohttp itself makes an idempotent request again once, when a connection
    it reused turns out closed)."""
    calls: Calls = Counter()

    async def handle(request: web.Request) -> web.Response:
        calls[request.path] += 1
        if calls[request.path] <= 2:
            _drop(request)
        return web.json_response({"instances": []})

    app = web.Application()
    app.router.add_get("/v1/instances", handle)
    app.router.add_post("/v1/instances/{id}/terminate", handle)
    async with served(app) as url:
        yield url, calls


@pytest.fixture
async def session_server() -> AsyncIterator[tuple[str, Calls]]:
    """A server whose session takes each call and drops the connection before any
    answer, except a ``result`` call on the third session or later, answered 42."""
    calls: Calls = Counter()

    async def session(request: web.Request) -> web.WebSocketResponse:
        calls["sessions"] += 1
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            for call in json.loads(message.data):
                calls[call["op"]] += 1
                if call["op"] == "result" and calls["sessions"] >= 3:
                    await ws.send_str(json.dumps([{"id": call["id"], "ok": 42}]))
                elif call["op"] != "hold":
                    _drop(request)
        return ws

    app = web.Application()
    app.router.add_get("/v1/session", session)
    async with served(app) as url:
        yield url, calls


async def test_a_read_whose_connection_broke_is_asked_again(
    dropping: tuple[str, Calls],
) -> None:
    url, calls = dropping
    async with Client.connect(url) as client:
        assert await client.list() == []
    assert calls["/v1/instances"] == 3


async def test_a_command_cut_off_is_not_sent_again(
    dropping: tuple[str, Calls], session_server: tuple[str, Calls]
) -> None:
    """As a request (terminate) or on the session (the others)."""
    (url, calls), (session_url, session_calls) = dropping, session_server
    async with Client.connect(url) as client, Client.connect(session_url) as session:
        with pytest.raises(ConnectionLost, match="may have been applied or not") as lost:
            await client.terminate("o-1", reason="test")
        with pytest.raises(ConnectionLost, match="during cancel_workflow; it may have been"):
            await session.cancel("o-1", reason="test")
        with pytest.raises(ConnectionLost, match="during send_event; it may have been"):
            await session.send_event("o-1", "go", None, event_id="e-1")
    assert isinstance(lost.value, ConnectionFailed)  # what callers already catch
    assert not lost.value.retriable  # the CLI exits 1, not 4: look before sending again
    assert calls["/v1/instances/o-1/terminate"] == 1
    assert (session_calls["cancel_workflow"], session_calls["send_event"]) == (1, 1)


async def test_a_wait_is_asked_again_on_a_new_session(
    session_server: tuple[str, Calls],
) -> None:
    url, calls = session_server
    async with Client.connect(url) as client:
        # The first two sessions drop the wait at once; the second drop comes right
        # after a loss, a server that drops every connection as far as the client
        # knows: it gives up.
        with pytest.raises(ConnectionLost) as lost:
            await client.result("o-1", timeout=30)
        assert lost.value.retriable  # a wait: asking again later is safe
        assert calls["result"] == 2
        # The third session answers.
        assert await client.result("o-1", timeout=30) == 42


async def test_a_server_that_drops_every_read_is_given_up_on_at_once() -> None:
    calls: Calls = Counter()

    async def drop(request: web.Request) -> web.Response:
        calls[request.path] += 1
        _drop(request)
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/v1/instances", drop)
    async with served(app) as url, Client.connect(url) as client:
        with pytest.raises(ConnectionLost, match="wants https://") as lost:
            await client.list()
    assert lost.value.retriable
    assert calls["/v1/instances"] <= 4  # two tries, each perhaps made twice by aiohttp


async def test_closing_the_client_ends_its_waits_at_once() -> None:
    async def session(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for _ in ws:
            pass  # never answers
        return ws

    app = web.Application()
    app.router.add_get("/v1/session", session)
    async with served(app) as url:
        client = await Client.connect(url)
        waiting = asyncio.ensure_future(client.result("o-1", timeout=30))
        await asyncio.sleep(0.2)
        await client.close()
        with pytest.raises(ConnectionFailed):
            await asyncio.wait_for(waiting, 5)


def test_a_lost_connection_keeps_its_class_across_the_wire() -> None:
    again = error_from_wire(error_to_wire(ConnectionLost("lost it"))["error"])
    assert type(again) is ConnectionLost and str(again) == "lost it"
