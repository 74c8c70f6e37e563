"""Many waits from one http:// client do not starve its other calls.

One client, a real `stepstream dev`: start 2,000 instances that wait for an event, await
all their results at once, then send the 2,000 events from the same client. Every send
and every result must complete; waits must not hold the connections that sends need.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from stepstream import Client
from tests.dev_server import DevServer, start_dev

N = 2_000
MODULE = "ss_load_flows"
WORKFLOWS = """
from stepstream import Context, workflow


@workflow("gate")
async def gate(ctx: Context, n):
    event = await ctx.wait_for_event("go")
    return {"n": n, "event": event}
"""


@pytest.fixture
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    server = start_dev(tmp_path_factory.mktemp("http-load"), MODULE, WORKFLOWS)
    yield server
    server.stop()


async def test_thousands_of_waits_and_sends_from_one_client(dev: DevServer) -> None:
    began = time.monotonic()
    async with Client.connect(dev.url, timeout=30) as client:
        ids = [f"load-{i}" for i in range(N)]
        await asyncio.gather(*(client.start("gate", i, instance_id=ids[i]) for i in range(N)))
        results = [asyncio.ensure_future(client.result(i, timeout=120)) for i in ids]
        await asyncio.sleep(0.5)  # the waits are in place before the sends begin
        assert not any(r.done() for r in results), [r for r in results if r.done()][:1]
        started = time.monotonic()
        await asyncio.gather(*(client.send_event(i, "go", i) for i in ids))
        sent = time.monotonic() - started
        answers = await asyncio.gather(*results)
    assert answers == [{"n": n, "event": f"load-{n}"} for n in range(N)]
    took = time.monotonic() - began
    print(f"{N} starts, waits and sends in {took:.1f} s (sends {sent:.1f} s)")
