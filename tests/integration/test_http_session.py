"""A hostile client of the ``/v1/session`` websocket cannot grow the server without bound.

The API runs in this process over an embedded engine (so the test can count what the
server holds); the client is a raw websocket that repeats call ids, asks for more calls
than a session may hold, sends frames too big or too deep, then disconnects. The server
must answer the excess with errors, keep its calls in flight bounded, cancel every call
when the client goes away, and go on serving everyone else.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from stepstream.ops.api.routes import SESSIONS, make_app
from stepstream.ops.embedded import EmbeddedConfig, EmbeddedEngine, open_embedded
from stepstream.producers.client import Client, Transport
from stepstream.producers.http.wire import SESSION_FRAME_CALLS, SESSION_MAX_CALLS
from tests import conftest


class CountingTransport:
    """The engine's transport, counting the result waits running and cancelled."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.waiting = 0
        self.cancelled = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def result(self, instance_id: str, timeout: float | None) -> Any:
        self.waiting += 1
        try:
            return await self.inner.result(instance_id, timeout)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.waiting -= 1


@dataclass
class Served:
    url: str
    engine: EmbeddedEngine
    transport: CountingTransport
    app: web.Application


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    engine = await open_embedded(
        conftest.test_registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    )
    transport = CountingTransport(engine.transport)
    app = make_app(transport)  # type: ignore[arg-type]
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield Served(f"http://{host}:{port}", engine, transport, app)
    finally:
        await runner.cleanup()
        await engine.close()


async def until(
    condition: Callable[[], bool], what: Callable[[], str], timeout: float = 20
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout} s waiting until {what()}")
        await asyncio.sleep(0.02)


class Replies:
    """Everything the server sent, by call id."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.errors: list[dict[str, Any]] = []
        self.ok: list[dict[str, Any]] = []
        self._task = asyncio.ensure_future(self._read(ws))

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        async for message in ws:
            if message.type == aiohttp.WSMsgType.TEXT:
                for reply in json.loads(message.data):
                    (self.errors if "error" in reply else self.ok).append(reply)

    def messages(self) -> set[str]:
        return {e["error"]["message"] for e in self.errors}

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def calls(ids: range | list[int], instance_id: str) -> str:
    return json.dumps([{"id": i, "op": "result", "instance_id": instance_id} for i in ids])


async def test_repeated_ids_and_too_many_calls_get_errors_and_leave_nothing_behind(
    served: Served,
) -> None:
    sessions = served.app[SESSIONS]
    waiting = served.transport
    async with Client(served.engine.transport) as client:
        await client.start("waiter", None, instance_id="w-1")

    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(served.url + "/v1/session")
        replies = Replies(ws)

        # the same id, over and over: the first runs, every repeat is refused
        for _ in range(5):
            await ws.send_str(calls([1] * SESSION_FRAME_CALLS, "w-1"))
        repeats = 5 * SESSION_FRAME_CALLS - 1
        await until(
            lambda: len(replies.errors) == repeats,
            lambda: f"{repeats} errors for repeated ids, got {len(replies.errors)}",
        )
        assert {e["id"] for e in replies.errors} == {1}
        assert replies.messages() == {
            "call id 1 is still in flight in this session; use a new id for each call"
        }
        assert replies.errors[0]["error"]["type"] == "InvalidPayload"
        assert sessions.calls_in_flight == 1 and waiting.waiting == 1

        # more calls than a session may hold: the excess is refused at once
        extra = 1_000
        ids = list(range(2, SESSION_MAX_CALLS + extra + 1))
        for start in range(0, len(ids), SESSION_FRAME_CALLS):
            await ws.send_str(calls(ids[start : start + SESSION_FRAME_CALLS], "w-1"))
        await until(
            lambda: len(replies.errors) == repeats + extra,
            lambda: f"{extra} more errors, got {len(replies.errors) - repeats}",
        )
        refused = replies.errors[repeats:]
        assert {e["id"] for e in refused} == set(ids[-extra:])
        assert (
            f"this session has {SESSION_MAX_CALLS} calls in flight"
            in refused[0]["error"]["message"]
        )
        await until(
            lambda: waiting.waiting == SESSION_MAX_CALLS,
            lambda: f"{SESSION_MAX_CALLS} waits, have {waiting.waiting}",
        )
        assert sessions.calls_in_flight == SESSION_MAX_CALLS
        assert replies.ok == []

        # a cancel frees a slot, and a new id takes it
        await ws.send_str(json.dumps([{"id": 2, "op": "cancel"}]))
        await ws.send_str(calls([SESSION_MAX_CALLS + extra + 1], "w-1"))
        await until(lambda: waiting.cancelled == 1, lambda: "the cancelled call to end")
        await until(
            lambda: waiting.waiting == SESSION_MAX_CALLS,
            lambda: f"{SESSION_MAX_CALLS} waits again, have {waiting.waiting}",
        )
        assert len(replies.errors) == repeats + extra

        # the client goes away: every call it left is cancelled
        await ws.close()
        await replies.close()
        await until(
            lambda: sessions.calls_in_flight == 0 and waiting.waiting == 0,
            lambda: f"no calls left, have {sessions.calls_in_flight} ({waiting.waiting} waits)",
        )
        assert waiting.cancelled == SESSION_MAX_CALLS + 1
        assert sessions.sessions == 0

    # the server still serves: a session client gets its answer
    async with Client.connect(served.url) as remote:
        async with Client(served.engine.transport) as local:
            await local.send_event("w-1", "approval", {"ok": True})
        assert await remote.result("w-1", timeout=10) == {"ok": True}


async def test_frames_too_big_too_many_or_too_deep_close_the_session(served: Served) -> None:
    sessions = served.app[SESSIONS]
    async with aiohttp.ClientSession() as http:
        for frame, code in (
            (calls(list(range(SESSION_FRAME_CALLS + 1)), "x"), aiohttp.WSCloseCode.MESSAGE_TOO_BIG),
            ("[" + " " * (3 * 1024 * 1024) + "]", aiohttp.WSCloseCode.MESSAGE_TOO_BIG),
            ("[" * 100_000, aiohttp.WSCloseCode.UNSUPPORTED_DATA),
            ('[{"id": 1, "op": "status", "instance_id": "\\ud800"}]', 1003),
            ('{"id": 1}', aiohttp.WSCloseCode.UNSUPPORTED_DATA),
        ):
            ws = await http.ws_connect(served.url + "/v1/session")
            await ws.send_str(frame)
            message = await ws.receive(timeout=10)
            assert message.type == aiohttp.WSMsgType.CLOSE, (frame[:40], message)
            assert ws.close_code == code, (frame[:40], ws.close_code, message.extra)
            await ws.close()
        await until(lambda: sessions.sessions == 0, lambda: "every session closed")

        # calls without a usable id are answered, not dropped in silence
        ws = await http.ws_connect(served.url + "/v1/session")
        await ws.send_str(json.dumps([{"op": "status"}, {"id": True}, 7]))
        message = await ws.receive(timeout=10)
        assert [r["id"] for r in json.loads(message.data)] == [None, None, None]
        await ws.close()
