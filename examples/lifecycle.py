"""Start policies, a run's timeout and terminate (docs/workflows.md).

``python -m examples.lifecycle`` runs the story below on an embedded engine with a
virtual clock, so the week-long timeout takes no wall time, and prints each outcome.
"""

from __future__ import annotations

import asyncio
from typing import Any

from stepstream import (
    Context,
    InstanceExists,
    WorkflowTerminated,
    WorkflowTimeout,
    workflow,
)
from stepstream.testing import WorkflowEnvironment

WEEK = 7 * 86400


def reserve(order: dict[str, Any]) -> str:
    return f"reserved {order['sku']}"


@workflow("fulfil", timeout=WEEK)  # the whole run; past it: WorkflowTimeout
async def fulfil(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    reservation = await ctx.step("reserve", reserve, order)
    shipped = await ctx.wait_for_event("shipped")
    return {"reservation": reservation, "shipped": shipped}


async def main() -> None:
    async with WorkflowEnvironment([fulfil], clock="virtual") as env:
        client = env.client
        await client.start("fulfil", {"sku": "book"}, instance_id="f-1")
        try:
            await client.start("fulfil", {"sku": "pen"}, instance_id="f-1", if_exists="fail")
        except InstanceExists as exc:
            print(f"fail: {exc.status}")  # fail: running

        await env.advance(WEEK)  # nobody ships it within the week
        try:
            await client.result("f-1", timeout=5)
        except WorkflowTimeout as exc:
            print(f"timeout: {exc.error_type}")  # timeout: WorkflowTimeout

        await client.start(
            "fulfil", {"sku": "book"}, instance_id="f-1", if_exists="restart_if_failed"
        )
        await env.settle()
        await client.send_event("f-1", "shipped", {"carrier": "dhl"})
        result = await client.result("f-1", timeout=5)
        print(
            f"run {(await client.status('f-1')).run}: {result['shipped']}"
        )  # run 2: {'carrier': 'dhl'}

        await client.start("fulfil", {"sku": "lamp"}, instance_id="f-2")
        await env.settle()
        await client.terminate("f-2", reason="supplier gone")
        try:
            await client.result("f-2", timeout=5)
        except WorkflowTerminated as exc:
            print(f"terminate: {exc.reason}")  # terminate: supplier gone


if __name__ == "__main__":
    asyncio.run(main())
