"""The http:// client's commands travel as calls on its ``/v1/session`` websocket, many to
a frame, with the same answers and errors as the HTTP routes; a big one goes as a request
of its own. Through the public client against the real API over an embedded engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from engine.errors import (
    InstanceFinished,
    InstanceNotPaused,
    InvalidPayload,
    UnknownInstance,
    UnknownWorkflow,
    WorkflowCancelled,
)
from ops.api import make_app
from ops.embedded import EmbeddedConfig, open_embedded
from producers.client import Client
from producers.http import SESSION_COMMAND_BYTES
from tests import conftest


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """The API's URL, and the paths of the POST requests it served."""
    engine = await open_embedded(
        conftest.test_registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    )
    posts: list[str] = []

    @web.middleware
    async def count(request: web.Request, handler: web.RequestHandler) -> web.StreamResponse:
        if request.method == "POST":
            posts.append(request.path)
        return await handler(request)

    app = make_app(engine.transport)
    app.middlewares.append(count)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", posts
    finally:
        await runner.cleanup()
        await engine.close()


async def test_commands_go_on_the_session_with_the_routes_answers(
    api: tuple[str, list[str]],
) -> None:
    url, posts = api
    async with Client.connect(url) as client:
        # 200 starts at once share frames; each gets its own answer.
        ids = await asyncio.gather(
            *(client.start("arith", n, instance_id=f"a-{n}") for n in range(200))
        )
        assert ids == [f"a-{n}" for n in range(200)]
        assert await client.result("a-7", timeout=30) == {"total": 8, "doubled": 16}
        generated = await client.start("arith", 1)  # the server names it
        assert await client.result(generated, timeout=30) == {"total": 2, "doubled": 4}

        waiting = await client.start("waiter", None, instance_id="w-1")
        with pytest.raises(InstanceNotPaused):
            await client.resume(waiting)
        await client.pause(waiting)
        await client.send_event(waiting, "approval", {"ok": True}, event_id="e-1")
        await client.send_event(waiting, "approval", {"ok": True}, event_id="e-1")  # once
        await client.resume(waiting)
        assert await client.result(waiting, timeout=30) == {"ok": True}

        doomed = await client.start("waiter", None, instance_id="w-2")
        await client.cancel(doomed, reason="not needed")
        with pytest.raises(WorkflowCancelled, match="not needed"):
            await client.result(doomed, timeout=30)
        with pytest.raises(InstanceFinished):
            await client.send_event(doomed, "approval", 1)

        # Errors come back as the same classes, and the session goes on serving.
        with pytest.raises(UnknownWorkflow, match="no-such"):
            await client.start("no-such", 1)
        with pytest.raises(UnknownInstance):
            await client.pause("nobody")
        with pytest.raises(InvalidPayload):
            await client.send_event("w-1", "", 1)
        assert await client.start("arith", 2, instance_id="after-errors") == "after-errors"
    assert posts == []  # not one request for all of those commands


async def test_a_big_command_goes_as_a_request_of_its_own(api: tuple[str, list[str]]) -> None:
    url, posts = api
    big = "x" * (SESSION_COMMAND_BYTES + 1)
    async with Client.connect(url) as client:
        waiting = await client.start("waiter", None, instance_id="w-big")
        await client.send_event(waiting, "approval", big)
        assert await client.result(waiting, timeout=30) == big
    assert posts == ["/v1/instances/w-big/events"]
