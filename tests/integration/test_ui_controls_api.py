"""The web UI's control calls (``POST /ui/api/instances/{id}/{control}``) take the
fields their /v1 calls take: an event's ``event_id`` makes a repeat change nothing, and
a misspelled field is refused rather than dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from stepstream.ops.api.routes import make_app
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests.conftest import test_registry as workflows_of_tests


async def test_ui_controls_take_the_fields_of_their_v1_calls(tmp_path: Path) -> None:
    engine = await open_embedded(
        workflows_of_tests(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)
    )
    runner = web.AppRunner(make_app(engine.make_transport()))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}/ui/api/instances/two"
    try:
        client = Client(engine.make_transport())
        await client.start("two-events", None, instance_id="two")

        async def post(control: str, body: dict[str, Any]) -> tuple[int, Any]:
            async with aiohttp.ClientSession() as http:
                headers = {"Content-Type": "application/json"}
                async with http.post(
                    f"{base}/{control}", data=json.dumps(body), headers=headers
                ) as response:
                    return response.status, await response.json()

        event = {"name": "item", "payload": 1, "event_id": "once"}
        answered = await post("events", event)
        assert answered == (202, {"ok": True}), answered[1]
        assert (await post("events", event))[0] == 202  # the same event again
        status, answer = await post("events", {"name": "item", "paylod": 2})
        assert status == 400, answer
        assert "unknown paylod" in answer["error"]["message"]
        status, answer = await post("cancel", {"reason": 7})
        assert status == 400, answer
        assert (await client.status("two")).status == "running"
        # One event of the two sent with one id: the second wait still waits.
        await post("events", {"name": "item", "payload": 2})
        assert await client.result("two", timeout=20) == [1, 2]
    finally:
        await runner.cleanup()
        await engine.close()
