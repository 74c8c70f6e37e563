"""Schedules on a virtual clock (embedded): cron slots a day apart across a DST change,
catch-up bounded by the window after the engine was down over slots, and a kill -9
between slots, with no slot started twice or lost."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from stepstream import Client
from stepstream.engine.virtual_clock import VirtualClock
from stepstream.testing import WorkflowEnvironment
from tests import workflows


async def slot_ids(client: Client, name: str) -> list[str]:
    page = await client.list_page(prefix=f"{name}@", limit=500, order="id")
    return [i.instance_id for i in page.instances]


async def test_cron_slots_across_a_dst_day_with_a_crash() -> None:
    start = datetime(2026, 3, 7, 12, tzinfo=UTC)
    async with WorkflowEnvironment([workflows], clock="virtual", start=start) as env:
        await env.client.create_schedule(
            "nightly", "arith", cron="30 2 * * *", input=1, timezone="America/New_York"
        )
        await env.advance(86400)
        await env.crash()  # kill -9 between the slots
        await env.advance(86400)
        await env.crash(after_writes=3)  # and one cut short in the middle of a slot
        await env.advance(86400)
        ids = await slot_ids(env.client, "nightly")
        # 02:30 does not exist on 2026-03-08 in New York: that day's slot is 03:00 EDT.
        assert ids == [
            "nightly@2026-03-08T07:00:00Z",
            "nightly@2026-03-09T06:30:00Z",
            "nightly@2026-03-10T06:30:00Z",
        ]
        for instance_id in ids:
            assert await env.client.result(instance_id) == {"total": 2, "doubled": 4}
        info = await env.client.describe_schedule("nightly")
        assert (info.started, info.skipped) == (3, 0)
        assert info.next_run_at == "2026-03-11T06:30:00Z"


async def test_catch_up_is_bounded_by_the_window(tmp_path: Path) -> None:
    """The engine is down for an hour over slots a minute apart: the slots within the
    last 5 minutes start when it is back, the older ones are skipped and counted. (With
    overlap "skip" only the first of the late ones would start: it runs when the next
    falls due.)"""
    clock = VirtualClock(round(datetime(2026, 1, 1, tzinfo=UTC).timestamp() * 1000))
    data = tmp_path / "data"
    async with WorkflowEnvironment([workflows], clock, data_dir=data) as env:
        await env.client.create_schedule(
            "poll", "arith", every=60, input=1, catchup_window=300, overlap="allow"
        )
        await env.advance(60)
        assert await slot_ids(env.client, "poll") == ["poll@2026-01-01T00:01:00Z"]
    clock.advance(3600)  # nobody runs: 60 slots pass
    async with WorkflowEnvironment([workflows], clock, data_dir=data) as env:
        await env.advance(1)
        ids = await slot_ids(env.client, "poll")
        info = await env.client.describe_schedule("poll")
        assert ids == ["poll@2026-01-01T00:01:00Z"] + [
            f"poll@2026-01-01T00:{m:02d}:00Z" for m in range(56, 60)
        ] + ["poll@2026-01-01T01:00:00Z", "poll@2026-01-01T01:01:00Z"], ids
        assert info.skipped_catchup == 54, info
        assert info.started == len(ids)


async def test_resume_new_spec_and_trigger_count_from_when_they_came() -> None:
    """A control message that arrives hours into the schedule's wait acts at its own
    time: a resume runs none of the slots it was paused over, a new spec starts from the
    next slot after now, a trigger is named by now."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    async with WorkflowEnvironment([workflows], clock="virtual", start=start) as env:
        client = env.client
        await client.create_schedule("p", "arith", every=300, input=1, overlap="allow")
        await env.advance(301)
        await client.pause_schedule("p")
        await env.advance(2 * 3600)  # paused over 24 slots, until 02:05:01
        await client.resume_schedule("p")
        await env.advance(1)
        assert await slot_ids(client, "p") == ["p@2026-01-01T00:05:00Z"]
        info = await client.describe_schedule("p")
        assert (info.started, info.skipped_catchup) == (1, 0)
        assert info.next_run_at == "2026-01-01T02:10:00Z"

    async with WorkflowEnvironment([workflows], clock="virtual", start=start) as env:
        client = env.client
        await client.create_schedule("d", "arith", cron="0 0 * * *", input=1)
        await env.advance(10 * 3600 + 1800)  # 10:30, the daily slot is far off
        await client.trigger_schedule("d")
        await client.create_schedule("d", "arith", cron="0 * * * *", input=1)  # hourly
        await env.advance(1)
        assert await slot_ids(client, "d") == ["d@2026-01-01T10:30:00.000Z"]
        info = await client.describe_schedule("d")
        assert (info.started, info.triggered, info.skipped_catchup) == (1, 1, 0)
        assert info.next_run_at == "2026-01-01T11:00:00Z"


def test_the_example_prints_what_docs_schedules_shows() -> None:
    """docs/schedules.md shows the output of `python -m examples.schedules`: run it."""
    repo = Path(__file__).resolve().parents[2]
    page = (repo / "docs" / "schedules.md").read_text()
    block = re.search(r"```console\n\$ python -m examples\.schedules\n(.*?)```", page, re.S)
    assert block is not None, "docs/schedules.md lost its example block"
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(
        [sys.executable, "-m", "examples.schedules"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == block.group(1)
