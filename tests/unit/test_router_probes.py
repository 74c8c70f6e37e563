"""A kafka:// client's reads when owners are gone: the router tells a killed worker
(nothing listens at its address) from a slow or frozen one, and fails a read at once
only when nothing listens at any announced worker's address, a worker with no
partition yet (standing by, or restoring) included.

The workers here are real sockets on loopback: a live one answers the session
websocket, a frozen one accepts connections and never answers, a dead one is an
address nothing listens at. The members view is the client's own, fed the records a
worker announces."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web

from stepstream.engine.wire.topics import TopicNames
from stepstream.errors import ConnectionFailed, NotListening
from stepstream.producers.kafka.members import Member, MembersView
from stepstream.producers.kafka.routing import Router
from stepstream.producers.kafka.session import WorkerSession
from tests.http_site import served


class _View(MembersView):
    """The members view without a topic: announcements are applied as read."""

    def __init__(self) -> None:
        super().__init__()
        self._moved = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []

    def announce(self, worker: str, url: str, partitions: list[int], epoch: int) -> None:
        member = Member(worker, url, tuple(partitions), epoch, 2)
        self._apply(worker.encode(), member.encode(), int(time.time() * 1000))
        self._recompute()
        self._moved.set()
        for listener in self._listeners:
            listener()

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    async def changed(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._moved.wait(), timeout)
        except TimeoutError:
            return False
        self._moved.clear()
        return True

    async def synced(self, timeout: float) -> None:
        return None


def _dead_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # closed again: nothing listens there


@pytest.fixture
async def live() -> AsyncIterator[str]:
    """A worker that answers every call on its session with its own name."""

    async def session(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            calls = json.loads(message.data)
            await ws.send_str(json.dumps([{"id": c["id"], "ok": "answered"} for c in calls]))
        return ws

    app = web.Application()
    app.router.add_get("/v1/session", session)
    async with served(app) as url:
        yield url


@pytest.fixture
async def frozen() -> AsyncIterator[str]:
    """A worker stopped (SIGSTOP): the kernel accepts connections, nothing answers."""
    held: list[asyncio.StreamWriter] = []

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.close()
        server.close()


async def _status(router: Router, timeout: float = 10.0) -> tuple[str, float]:
    async def call(api: WorkerSession, remaining: float | None) -> str:
        return str(await api._calls.call("status", instance_id="i-1"))

    began = time.monotonic()
    answer = await router.routed(0, call, timeout, "status of i-1")
    return answer, time.monotonic() - began


def _router(view: _View, http: aiohttp.ClientSession) -> Router:
    return Router(view, http, TopicNames("t"), 2, request_timeout=10.0)


async def _read_handed_over(view: _View, to: str, url: str) -> float:
    """A read of partition 0, whose owner is gone, while worker ``to`` (at ``url``) takes
    both partitions over after 1 s: how long it took to be answered."""

    async def hand_over() -> None:
        await asyncio.sleep(1.0)
        view.announce(to, url, [0, 1], 2)

    async with aiohttp.ClientSession() as http:
        router = _router(view, http)
        moved = asyncio.ensure_future(hand_over())
        answer, took = await _status(router)
        assert answer == "answered"
        await moved
        await router.close()
    return took


async def test_with_every_announced_worker_killed_a_read_fails_at_once() -> None:
    view = _View()
    view.announce("w1", _dead_address(), [0], 1)
    view.announce("w2", _dead_address(), [1], 1)
    view.announce("w3", _dead_address(), [], 0)  # standing by when it was killed
    async with aiohttp.ClientSession() as http:
        router = _router(view, http)
        began = time.monotonic()
        with pytest.raises(ConnectionFailed) as failed:
            await _status(router)
        assert time.monotonic() - began < 5, "waited for a hand-over no worker can make"
        message = str(failed.value)
        assert "partition 0: its owner, worker w1" in message, message
        assert "worker w2, worker w3" in message and "were they killed?" in message, message
        assert "start `stepstream worker`" in message
        await router.close()


async def test_a_worker_without_partitions_that_listens_takes_the_read_over(live: str) -> None:
    """More workers than partitions, or one restoring: it owns nothing yet, but it will."""
    view = _View()
    view.announce("w1", _dead_address(), [0], 1)
    view.announce("w2", _dead_address(), [1], 1)
    view.announce("w3", live, [], 0)
    took = await _read_handed_over(view, "w3", live)
    assert took >= 0.9


async def test_a_frozen_worker_does_not_hold_the_read_back_from_a_live_one(
    live: str, frozen: str
) -> None:
    view = _View()
    view.announce("w1", _dead_address(), [0], 1)
    view.announce("w2", live, [1], 1)
    view.announce("w3", frozen, [], 0)
    took = await _read_handed_over(view, "w2", live)
    assert took < 5, took


async def test_only_a_connection_nothing_accepts_counts_as_not_listening() -> None:
    async def drop(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()  # accepted, then closed: something runs there

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    dropping = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with aiohttp.ClientSession() as http:
        router = _router(_View(), http)
        with pytest.raises(ConnectionFailed) as dropped:
            await router.api(dropping).probe()
        assert not isinstance(dropped.value, NotListening), dropped.value
        with pytest.raises(NotListening, match="cannot reach stepstream"):
            await router.api(_dead_address()).probe()
        await router.close()
    server.close()
