"""Messages through a real ``stepstream dev`` and the http:// client: request() waits for
the workflow's answer over the session, event ids make a retried send apply once, and the
HTTP API refuses an event id the engine keeps for itself."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from stepstream import Client, InvalidPayload
from tests.dev_server import start_dev

MODULE = "ss_messages_flows"
WORKFLOWS = """
from stepstream import Context, workflow


@workflow("quoter")
async def quoter(ctx: Context, _):
    answered = 0
    while True:
        msg = await ctx.messages.next(["quote", "stop"])
        if msg.name == "stop":
            return answered
        await msg.complete({"price": msg.payload["qty"] * 3})
        answered += 1
"""


async def test_request_and_event_ids_over_http(tmp_path: Path) -> None:
    dev = start_dev(tmp_path, MODULE, WORKFLOWS)
    try:
        async with Client.connect(dev.url) as client:
            await client.start("quoter", None, instance_id="q-1")
            answers = await asyncio.gather(
                *(client.request("q-1", "quote", {"qty": n}, timeout=20) for n in range(1, 6))
            )
            assert sorted(a["price"] for a in answers) == [3, 6, 9, 12, 15]
            with pytest.raises(InvalidPayload, match="reserved"):
                await client.send_event("q-1", "stop", None, event_id="child:1:x/y")
            await client.send_event("q-1", "stop", None, event_id="stop-once")
            await client.send_event("q-1", "stop", None, event_id="stop-once")
            assert await client.result("q-1", timeout=20) == 5
        # The raw API: event_id travels in the body; a reserved one is a 400.
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{dev.url}/v1/instances/q-1/events",
                data=json.dumps({"name": "x", "event_id": "a:b"}),
                headers={"Content-Type": "application/json"},
            ) as response:
                assert response.status == 400, await response.text()
    finally:
        dev.stop()


def test_send_with_an_event_id_applies_once_through_the_cli(tmp_path: Path) -> None:
    dev = start_dev(tmp_path, MODULE, WORKFLOWS)
    try:
        assert dev.cli("start", "quoter", "--id", "q-cli").returncode == 0
        for _ in range(2):
            sent = dev.cli("send", "q-cli", "stop", "--event-id", "stop-cli")
            assert sent.returncode == 0, sent.stderr
        status = json.loads(dev.cli("status", "q-cli", "--json").stdout)
        assert status["status"] == "completed", status
        history = json.loads(dev.cli("history", "q-cli", "--json").stdout)
        stops = [
            h
            for h in history
            if h["type"] == "MessagesReceived" and h["attributes"]["names"] == ["stop"]
        ]
        assert len(stops) == 1, history
        refused = dev.cli("send", "q-cli", "stop", "--event-id", "a:b")
        assert refused.returncode != 0 and "reserved" in refused.stderr
    finally:
        dev.stop()
