"""A parent restarted with restart_if_failed that starts a child of a fixed id again
gets the child's outcome (docs/workflows.md, start policies): the first run's start
and the child's notice must not be taken for the new run's, with one partition or
several, and across a crash."""

from __future__ import annotations

from typing import Any

import pytest

from stepstream import Context, NonRetryableError, workflow
from stepstream.engine.api.workflow import Registry
from stepstream.testing import WorkflowEnvironment


def refuse(mode: str) -> None:
    if mode == "fail":
        raise NonRetryableError("late failure")


@workflow("fixed-kid")
async def kid(ctx: Context, value: Any) -> Any:
    return value


@workflow("fixed-parent")
async def parent(ctx: Context, mode: str) -> Any:
    got = await ctx.child("fixed-kid", "ok", instance_id="the-kid")
    await ctx.step("check", refuse, mode)
    return got


@pytest.mark.parametrize("partitions", [1, 3])
async def test_a_restarted_parent_gets_its_fixed_childs_outcome(partitions: int) -> None:
    registry = Registry()
    registry.add(kid)
    registry.add(parent)
    async with WorkflowEnvironment(registry, clock="virtual", partitions=partitions) as env:
        await env.client.start("fixed-parent", "fail", instance_id="p")
        await env.advance(1)
        assert (await env.client.status("p")).status == "failed"
        await env.client.start("fixed-parent", "ok", instance_id="p", if_exists="restart_if_failed")
        await env.advance(1)
        await env.crash()
        await env.advance(1)
        assert await env.client.result("p") == "ok"
        started = [h for h in await env.client.history("the-kid") if h.type == "WorkflowStarted"]
        assert len(started) == 1  # the child ran once; the second run got its outcome
