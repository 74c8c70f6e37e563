"""Workflows for the web UI's browser tests: one run touches every kind of timeline row
(a retried step with its backoff, a sleep, a wait for an event, a child, a saga's
compensation), one waits until told to finish, and one retries a step four times."""

from __future__ import annotations

from typing import Any

from stepstream import (
    Context,
    NonRetryableError,
    RetryPolicy,
    RolledBack,
    StepFailed,
    workflow,
)

_calls: dict[str, int] = {}


def flaky(key: str) -> str:
    # Fails its first attempt, so the timeline shows a retry and its backoff.
    _calls[key] = _calls.get(key, 0) + 1
    if _calls[key] == 1:
        raise RuntimeError("the first attempt always fails")
    return f"ok after {_calls[key]} attempts"


def book(what: str) -> str:
    return f"booked {what}"


def undo(booking: str) -> str:
    return f"undid {booking}"


def refuse(_: str) -> str:
    raise NonRetryableError("card declined by the issuer")


def stubborn_call(key: str) -> str:
    # Fails four attempts, then succeeds: five attempts on one timeline line.
    _calls[key] = _calls.get(key, 0) + 1
    if _calls[key] < 5:
        raise ConnectionError(f"upstream refused attempt {_calls[key]}")
    return "finally"


@workflow("stubborn")
async def stubborn(ctx: Context, _: Any) -> str:
    """One step retried four times before it succeeds, then a step that fails for good."""
    policy = RetryPolicy(max_attempts=6, initial_interval=0.05, backoff=1.0)
    value: str = await ctx.step("call", stubborn_call, ctx.instance_id, retry=policy)
    try:
        await ctx.step("refuse", refuse, "card")
    except StepFailed:
        pass
    return value


@workflow("leaf")
async def leaf(ctx: Context, value: int) -> int:
    return await ctx.step("double", lambda: value * 2)


@workflow("tour")
async def tour(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    """Every kind of row: retry + backoff, child, saga compensation, sleep, wait."""
    flaky_result = await ctx.step(
        "flaky", flaky, ctx.instance_id, retry=RetryPolicy(max_attempts=3, initial_interval=0.3)
    )
    child = await ctx.start_child("leaf", 21, name="leaf")
    doubled = await child.result()
    try:
        async with ctx.saga("trip"):
            await ctx.step("hotel", book, "hotel", compensate=undo)
            await ctx.step("pay", refuse, "card")
    except RolledBack:
        pass
    await ctx.sleep("rest", 0.2)
    approval = await ctx.wait_for_event("approval", timeout=3600)
    return {"flaky": flaky_result, "doubled": doubled, "approval": approval}


@workflow("gate")
async def gate(ctx: Context, _: Any) -> Any:
    """Waits for "go", then returns its payload; "fail" in it fails the instance."""
    payload = await ctx.wait_for_event("go", timeout=3600)
    if isinstance(payload, dict) and payload.get("fail"):
        raise NonRetryableError(f"told to fail: {payload['fail']}")
    return payload


@workflow("instant")
async def instant(ctx: Context, fail: bool) -> str:
    """Finishes at once: completed, or failed when told to (for listing at scale)."""
    if fail:
        raise NonRetryableError("failed on purpose")
    return "done"
