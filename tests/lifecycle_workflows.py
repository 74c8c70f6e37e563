"""Workflows for the lifecycle tests: start policies, a run's timeout, terminate."""

from __future__ import annotations

import asyncio
from typing import Any

from stepstream import Context, RetryPolicy, workflow


async def _hang(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "done"


@workflow("flaky-once")
async def flaky_once(ctx: Context, args: dict[str, Any]) -> Any:
    """Fails while its input says so; waits for "go" first when asked (to stay running)."""
    if args.get("wait"):
        await ctx.wait_for_event("go")
    if args.get("fail"):
        raise RuntimeError(f"run failed on purpose for {ctx.instance_id}")
    return {"ok": args.get("n", 0)}


@workflow("deadline", timeout=1.5)
async def deadline(ctx: Context, args: dict[str, Any]) -> Any:
    """Sleeps ``sleep`` seconds (or waits for an event), under a 1.5 s run timeout."""
    if args.get("hang_step"):
        await ctx.step("hang", _hang, 60.0, retry=RetryPolicy(max_attempts=1))
    if args.get("wait"):
        await ctx.wait_for_event("go")
    await ctx.sleep("nap", args.get("sleep", 0.0))
    return "in time"


@workflow("slow-deadline", timeout=6)
async def slow_deadline(ctx: Context, _: Any) -> Any:
    """Waits for an event that never comes; its 6 s run timeout ends it (fault tests)."""
    return await ctx.wait_for_event("never")


@workflow("terminable")
async def terminable(ctx: Context, args: dict[str, Any]) -> Any:
    """A saga with a long step in it, and a child waiting for an event: terminate must
    run no compensation, not wait for the step, and end the child too."""
    async with ctx.saga("book"):
        await ctx.step("reserve", _reserved, compensate=_undo)
        child = await ctx.start_child("flaky-once", {"wait": True})
        await ctx.step("hang", _hang, 60.0, retry=RetryPolicy(max_attempts=1))
        return await child.result()


def _reserved() -> str:
    return "reserved"


def _undo(_: Any) -> None:
    raise AssertionError("terminate must not run compensations")
