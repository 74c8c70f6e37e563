"""Arguments of the workflow language's calls that no record could hold are refused at
the call, as the instance's own failure, also when the call is reached only after a
sleep (a bad retry= once failed inside the engine on every timer fire instead, and the
instance ran for ever with no error; keep=2.5 could not be stored)."""

from __future__ import annotations

from typing import Any

import pytest

from stepstream import Context, WorkflowFailed, workflow
from stepstream.engine.api.workflow import Registry
from stepstream.testing import WorkflowEnvironment


def ok(value: Any) -> Any:
    return value


@workflow("bad-retry")
async def bad_retry(ctx: Context, _: Any) -> Any:
    await ctx.sleep("first", 0.01)
    return await ctx.step("a", ok, 1, retry=3)  # type: ignore[arg-type]


@workflow("bad-keep")
async def bad_keep(ctx: Context, _: Any) -> Any:
    async def body(ctx: Context, state: Any) -> Any:
        raise AssertionError("never runs")

    await ctx.sleep("first", 0.01)
    return await ctx.loop("l", body, keep=2.5)  # type: ignore[arg-type]


@workflow("bad-max")
async def bad_max(ctx: Context, _: Any) -> Any:
    await ctx.sleep("first", 0.01)
    return await ctx.messages.next_batch("q", max=2.5, timeout=1)  # type: ignore[arg-type]


@workflow("fine")
async def fine(ctx: Context, arg: int) -> int:
    await ctx.sleep("first", 0.01)
    return int(await ctx.step("a", ok, arg))


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("bad-retry", "retry=3 is not a stepstream.RetryPolicy"),
        ("bad-keep", "keep must be a whole number of at least 1, not 2.5"),
        ("bad-max", "max as a whole number of at least 1, not 2.5"),
    ],
)
async def test_a_bad_argument_fails_its_instance_saying_what(name: str, says: str) -> None:
    registry = Registry()
    for fn in (bad_retry, bad_keep, bad_max, fine):
        registry.add(fn)
    async with WorkflowEnvironment(registry, clock="system", partitions=1) as env:
        await env.client.start(name, None, instance_id="bad")
        with pytest.raises(WorkflowFailed, match="InvalidWorkflowCall") as failed:
            await env.client.result("bad", timeout=20)
        assert says in str(failed.value)
        await env.client.start("fine", 5, instance_id="fine")
        assert await env.client.result("fine", timeout=20) == 5
