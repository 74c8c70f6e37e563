"""An http:// client under a steady load of more requests than its connection pool
holds serves them in turn: none starves until its timeout while others go on.

Found by ``stepstream bench --workload timers --client http``: with 500 starts always in
flight on the 100-connection pool, aiohttp gave each freed connection to the next request
made, so the 400 requests already waiting never got one and failed after 30 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from stepstream import Client
from tests.dev_server import DevServer, start_dev

MODULE = "ss_pool_flows"
WORKFLOWS = """
from stepstream import Context, workflow


@workflow("answer")
async def answer(ctx: Context, n):
    return n
"""
CALLERS = 300  # three times the pool
TIMEOUT_S = 2.5
LOAD_S = 2 * TIMEOUT_S  # long enough for a starved request to reach its timeout


@pytest.fixture
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    server = start_dev(tmp_path_factory.mktemp("http-pool"), MODULE, WORKFLOWS)
    yield server
    server.stop()


async def test_requests_beyond_the_pool_are_served_in_turn(dev: DevServer) -> None:
    async with Client.connect(dev.url, timeout=TIMEOUT_S) as client:
        await client.start("answer", 1, instance_id="pool-1")
        await client.result("pool-1", timeout=30)
        calls = [0] * CALLERS
        until = time.monotonic() + LOAD_S

        async def caller(index: int) -> None:
            # Each caller asks again as soon as it is answered: a steady load of
            # CALLERS requests, never a burst that drains.
            while time.monotonic() < until:
                assert (await client.status("pool-1")).status == "completed"
                calls[index] += 1

        await asyncio.gather(*(caller(i) for i in range(CALLERS)))
    assert all(calls), f"{calls.count(0)} of {CALLERS} callers were never answered"
