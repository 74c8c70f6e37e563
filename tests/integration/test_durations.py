"""Durations a workflow gives the engine are refused when no record could hold them
(infinite, NaN, or longer than a hundred years): at definition for a workflow's
timeout, a retry policy or a queue's window, and as the workflow's own failure for a
sleep or a wait, while the rest of its partition goes on."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest

from stepstream import Context, Queue, RetryPolicy, WorkflowFailed, workflow
from stepstream.engine.api.workflow import Registry
from stepstream.testing import WorkflowEnvironment


@pytest.mark.parametrize("timeout", [math.inf, 1e300, math.nan, timedelta(days=365 * 101)])
def test_a_workflow_timeout_no_record_could_hold_is_refused(timeout: Any) -> None:
    with pytest.raises(ValueError, match="timeout="):
        workflow("too-long", timeout=timeout)


def test_retry_intervals_and_queue_windows_are_bounded() -> None:
    with pytest.raises(ValueError, match=r"RetryPolicy\.max_interval is longer than the 100"):
        RetryPolicy(max_interval=1e300)
    with pytest.raises(ValueError, match=r"RetryPolicy\.initial_interval is not a number"):
        RetryPolicy(initial_interval=math.nan)
    with pytest.raises(ValueError, match=r"RetryPolicy\.initial_interval must not be negative"):
        RetryPolicy(initial_interval=-1)
    for rate in [(1, math.inf), (5,), (True, 1), (5, "10")]:
        with pytest.raises(ValueError, match="rate must be"):
            Queue("q", rate=rate)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="concurrency must be a whole number"):
        Queue("q", concurrency=True)
    assert workflow("a-century", timeout=timedelta(days=365 * 99)) is not None
    assert RetryPolicy(max_interval=86400).max_interval == 86400


async def test_a_sleep_too_long_fails_its_instance_and_the_partition_goes_on() -> None:
    registry = Registry()

    @workflow("sleeps-for-ever")
    async def sleeps(ctx: Context, seconds: float) -> None:
        await ctx.sleep("nap", seconds)

    @workflow("waits-for-ever")
    async def waits(ctx: Context, seconds: float) -> Any:
        return await ctx.wait_for_event("go", timeout=seconds)

    @workflow("plain")
    async def plain(ctx: Context, arg: int) -> int:
        return arg + 1

    for fn in (sleeps, waits, plain):
        registry.add(fn)
    async with WorkflowEnvironment(registry, partitions=1) as env:
        client = env.client
        for name, seconds in [("sleeps-for-ever", 1e300), ("waits-for-ever", 1e299)]:
            instance = await client.start(name, seconds, instance_id=name)
            with pytest.raises(WorkflowFailed, match="duration is longer than the 100 years"):
                await client.result(instance, timeout=10)
        instance = await client.start("plain", 1, instance_id="after")
        assert await client.result(instance, timeout=10) == 2
