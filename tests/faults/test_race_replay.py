"""A losing race branch that read recorded values (ctx.now, ctx.random, ctx.uuid,
attributes) before it lost: after a crash, replay runs only the winner, and the values
the loser recorded must not count as code the workflow no longer reaches (they once
parked the instance with HistoryDiverged, for good)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from stepstream import Context, workflow
from stepstream.engine.api.workflow import Registry
from stepstream.testing import WorkflowEnvironment


async def reads_values_then_waits(ctx: Context) -> str:
    ctx.now()
    ctx.random()
    ctx.uuid()
    ctx.set_attributes({"branch": "loser"})
    await ctx.wait_for_event("never")
    return "loser"


async def sleeps(ctx: Context) -> str:
    await ctx.sleep("deadline", 10)
    return "deadline"


@workflow("race-values")
async def race_values(ctx: Context, _: Any) -> str:
    winner, _value = await ctx.race({"a": reads_values_then_waits, "b": sleeps})
    await ctx.sleep("after", 100)
    return winner


async def test_values_a_loser_recorded_do_not_park_the_replay() -> None:
    registry = Registry()
    registry.add(race_values)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    async with WorkflowEnvironment(registry, clock="virtual", start=start) as env:
        await env.client.start("race-values", None, instance_id="r-1")
        await env.advance(20)  # "b" won; the instance sleeps "after"
        await env.crash()  # its code replays from history
        await env.advance(200)
        status = await env.client.status("r-1")
        assert (status.status, status.error) == ("completed", None)
        assert await env.client.result("r-1") == "b"
