"""Schedules: a report every night at 02:00 Paris time, run for two days on a virtual
clock (no waiting), across the night Paris moves to summer time.

    python -m examples.schedules

On 2026-03-29 02:00 does not exist in Paris (clocks go from 02:00 to 03:00), so that
night's slot runs at 03:00 CEST; every slot is a UTC instant and names its instance.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from stepstream import Context, workflow
from stepstream.testing import WorkflowEnvironment


def build_report(team: str) -> str:
    return f"report for {team}"


@workflow("report")
async def report(ctx: Context, args: dict[str, Any]) -> str:
    return await ctx.step("build", build_report, args["team"])


async def main() -> None:
    start = datetime(2026, 3, 28, 12, tzinfo=UTC)
    async with WorkflowEnvironment([report], clock="virtual", start=start) as env:
        client = env.client
        await client.create_schedule(
            "nightly", "report", cron="0 2 * * *", input={"team": "ops"}, timezone="Europe/Paris"
        )
        await env.advance(2 * 86400)
        for s in await client.list_schedules():
            print(f"{s.name}: {s.spec}, next run {s.next_run_at}, last {s.last_instance_id}")
        for instance in (await client.list_page(prefix="nightly@", order="id")).instances:
            print(instance.instance_id, "->", await client.result(instance.instance_id))


if __name__ == "__main__":
    asyncio.run(main())
