"""A client's wait across a restart of `stepstream dev`: killed with -9 and started
again by its supervisor on the same port and data, the server answers the wait that the
http:// client asks again, and a read made while it is down is refused at once."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from stepstream import Client
from stepstream.errors import NotListening
from tests.dev_server import DevServer, free_port, start_dev

pytestmark = pytest.mark.slow

WORKFLOWS = """
from stepstream import workflow


@workflow("gate")
async def gate(ctx, n):
    return n + (await ctx.wait_for_event("go"))
"""


def test_a_wait_outlives_a_restart_of_the_server(tmp_path: Path) -> None:
    port = str(free_port())
    servers: list[DevServer] = [start_dev(tmp_path, "flows", WORKFLOWS, "--port", port)]

    async def scenario() -> object:
        async with Client.connect(servers[0].url) as client:
            await client.start("gate", 40, instance_id="g-1")
            waiting = asyncio.ensure_future(client.result("g-1", timeout=60))
            await asyncio.sleep(0.3)  # the wait is on the server's session now
            servers[0].proc.send_signal(signal.SIGKILL)
            servers[0].proc.wait()
            # Down: a new call is refused at once, nothing was lost under it.
            async with Client.connect(servers[0].url) as fresh:
                with pytest.raises(NotListening):
                    await fresh.status("g-1")
            servers.append(
                await asyncio.to_thread(start_dev, tmp_path, "flows", WORKFLOWS, "--port", port)
            )
            assert not waiting.done()
            await client.send_event("g-1", "go", 2)
            return await waiting

    try:
        assert asyncio.run(scenario()) == 42
    finally:
        for server in servers[1:]:
            server.stop()
