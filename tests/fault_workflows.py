"""Workflows for the network and disk fault tests (importable by worker and `stepstream
dev` subprocesses): long enough to be running while a fault is injected."""

from __future__ import annotations

import asyncio
from typing import Any

from stepstream import Context, RetryPolicy, workflow

# Generous: an attempt a fault cuts short is recorded as lost and counts against this.
PATIENT = RetryPolicy(max_attempts=50, initial_interval=0.05, backoff=2.0, max_interval=1.0)


async def tick(value: int, seconds: float) -> int:
    await asyncio.sleep(seconds)
    return value + 1


@workflow("ticker")
async def ticker(ctx: Context, args: dict[str, Any]) -> dict[str, Any]:
    """``steps`` steps of ``seconds`` each, and a durable sleep after every fifth: a
    workflow that keeps committing (history, timers) for as long as a fault lasts."""
    value = 0
    for i in range(args["steps"]):
        value = await ctx.step(f"t{i}", tick, value, args["seconds"], retry=PATIENT)
        if i % 5 == 4:
            await ctx.sleep(f"z{i}", args["seconds"])
    return {"id": ctx.instance_id, "ticks": value}


@workflow("gate")
async def gate(ctx: Context, _: Any) -> Any:
    """Waits for its ``open`` event and returns what it carries: a result nobody can get
    before the test sends it, however slow the machine."""
    return await ctx.wait_for_event("open")
