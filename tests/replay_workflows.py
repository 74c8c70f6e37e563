"""Workflows for the forced-replay tests of tests/faults/test_language_replays.py
(importable by `stepstream dev`): round-2 constructs ``tests.workflows`` has no workflow
for (try_step's failure kinds, a race lost by a running step, compensations slow enough to
be killed in), and variants of its workflows that sit idle between their steps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from stepstream import Context, NonRetryableError, RetryPolicy, RolledBack, workflow
from tests.workflows import add, book, ledger, unbook


def always_fails() -> None:
    raise RuntimeError("always fails")


def refuses() -> None:
    raise NonRetryableError("refused for good")


async def overruns() -> str:
    await asyncio.sleep(30)  # cancelled by its 50 ms timeout
    return "late"


@workflow("tries")
async def tries(ctx: Context, _: Any) -> list[Any]:
    """One ``ctx.try_step`` of each failure kind a body can cause, a wait, then one that
    succeeds: replay must give each the same result object."""
    quick = RetryPolicy(max_attempts=2, initial_interval=0.01)
    results = [
        await ctx.try_step("flaky", always_fails, retry=quick),
        await ctx.try_step("fatal", refuses, retry=quick),
        await ctx.try_step("slow", overruns, timeout=0.05, retry=RetryPolicy(max_attempts=1)),
    ]
    go = await ctx.wait_for_event("go")
    fine = await ctx.try_step("fine", add, 1, 2)
    summary: list[Any] = [
        [r.ok, r.failure.kind, r.failure.attempts, r.failure.error_type]
        for r in results
        if r.failure is not None
    ]
    return [*summary, go, fine.ok, fine.value]


def outlives_the_race(name: str, seconds: float) -> str:
    """A sync body cannot be cancelled: it finishes after its branch lost."""
    ledger(f"{name}-started")
    time.sleep(seconds)
    ledger(f"{name}-finished")
    return "slow won"


@workflow("race-step")
async def race_step(ctx: Context, seconds: float) -> list[Any]:
    """A race between a running step and an event: the event wins, and the step's late
    success must never be recorded. The sleep and the wait after it let an eviction
    replay the decided race, before and after the abandoned body returned."""
    winner, value = await ctx.race(
        {
            "slow": lambda c: c.step(
                "work", outlives_the_race, ctx.instance_id, seconds, retry=RetryPolicy()
            ),
            "go": lambda c: c.wait_for_event("go"),
        }
    )
    # Idle (so evictable) while the abandoned body returns, then wait for "done".
    await ctx.sleep("linger", seconds)
    done = await ctx.wait_for_event("done")
    after = await ctx.step("after", add, 1, 1)
    return [winner, value, done, after]


# Variants of tests.workflows whose instances also sit idle between steps: a running step
# keeps its instance in the cache, so only an idle one can be evicted and replayed.


async def _part_with_a_wait(c: Context, part: str) -> list[Any]:
    first = await c.step("fetch", add, len(part), 0)
    got = await c.wait_for_event(part)
    return [first, got, await c.step("fetch", add, 1, 1)]


@workflow("join-waits")
async def join_waits(ctx: Context, parts: list[str]) -> Any:
    """join-parts with a wait in each branch (for an event named after the branch)."""

    def branch(part: str) -> Callable[[Context], Coroutine[Any, Any, list[Any]]]:
        return lambda c: _part_with_a_wait(c, part)

    return await ctx.join({p: branch(p) for p in parts})


@workflow("ephemeral-naps")
async def ephemeral_naps(ctx: Context, n: int) -> int:
    """ephemeral with a short sleep after each ephemeral step."""
    total = 0
    for i in range(n):
        total = await ctx.step("tick", add, total, i, ephemeral=True)
        await ctx.sleep("nap", 0.02)
    return total


@workflow("trip-confirm")
async def trip_confirm(ctx: Context, _: Any) -> str:
    """trip that waits inside the saga for "confirm": true books, false rolls back."""
    try:
        async with ctx.saga("booking"):
            await ctx.step("flight", book, "flight", compensate=unbook)
            await ctx.step("hotel", book, "hotel", compensate=unbook)
            if not await ctx.wait_for_event("confirm"):
                raise RuntimeError("not confirmed")
        return "booked"
    except RolledBack as exc:
        return f"rolled back: {exc.cause}"


def reserve(instance_id: str, what: str) -> str:
    return f"{instance_id}-{what}"


def slow_release(booking: str) -> None:
    """A compensation long enough to be killed in the middle of."""
    ledger(f"{booking}-release-started")
    time.sleep(0.5)
    ledger(f"{booking}-released")


@workflow("trip-slow-undo")
async def trip_slow_undo(ctx: Context, _: Any) -> str:
    """trip-confirm whose compensations take a while: "confirm" false rolls back."""
    try:
        async with ctx.saga("booking"):
            await ctx.step("flight", reserve, ctx.instance_id, "flight", compensate=slow_release)
            await ctx.step("hotel", reserve, ctx.instance_id, "hotel", compensate=slow_release)
            if not await ctx.wait_for_event("confirm"):
                raise RuntimeError("not confirmed")
        return "booked"
    except RolledBack as exc:
        return f"rolled back: {exc.cause}"
