"""Workflow time (docs/workflows.md): a new instance's clock starts when its start was
taken, so a sleep begun before anything else counts from that moment, however long the
engine took to get to the start."""

from __future__ import annotations

from datetime import timedelta

from stepstream import Context, workflow


def remind(user: str) -> str:
    return f"reminded {user}"


@workflow("reminder")
async def reminder(ctx: Context, request: dict) -> dict:
    started = ctx.now()  # when the start was taken
    await ctx.sleep("wait", request["after_s"])  # due at started + after_s
    sent = await ctx.step("remind", remind, request["user"])
    due = started + timedelta(seconds=request["after_s"])
    return {"sent": sent, "on_time": ctx.now() >= due}
