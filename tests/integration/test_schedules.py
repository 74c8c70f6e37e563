"""Schedules through the public client, on each backend, on the real clock (slots of a
second): one instance per slot named by it, overlap, pause, resume, trigger, delete."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from stepstream import Client, InstanceFinished, InvalidPayload, UnknownInstance, UnknownWorkflow

T = TypeVar("T")
SLOT_ID = re.compile(r"@\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


async def eventually(
    probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], timeout: float = 30
) -> T:
    """``probe()`` until ``ok`` holds of it (a Kafka worker applies commands after the
    client's call returns); fails with the last value."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = await probe()
        except UnknownInstance as exc:
            last = exc
        else:
            if ok(last):  # type: ignore[arg-type]
                return last  # type: ignore[return-value]
        await asyncio.sleep(0.2)
    raise AssertionError(f"not reached in {timeout}s; last: {last}")


async def started_ids(client: Client, name: str) -> list[str]:
    page = await client.list_page(prefix=f"{name}@", limit=500)
    return [i.instance_id for i in page.instances]


def new_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


async def test_each_slot_starts_one_instance_named_by_it(client: Client) -> None:
    name = new_name("tick")
    await client.create_schedule(name, "arith", every=1, input=4)
    info = await eventually(lambda: client.describe_schedule(name), lambda i: i.started >= 3)
    assert info.workflow == "arith" and info.spec == "every 1s" and not info.paused
    ids = await started_ids(client, name)
    assert all(SLOT_ID.search(i) for i in ids), ids
    assert len(ids) == len(set(ids))
    for instance_id in ids[:3]:
        await eventually(lambda: client.status(instance_id), lambda s: s.finished)  # noqa: B023
        assert await client.result(instance_id, timeout=20) == {"total": 5, "doubled": 10}
    assert info.last_instance_id is not None and info.last_instance_id.startswith(f"{name}@")
    assert info.next_run_at is not None and info.next_run_at > info.last_instance_id.split("@")[1]
    listed = {s.name: s for s in await client.list_schedules()}
    assert listed[name].workflow == "arith"


async def test_pause_resume_trigger_delete(client: Client) -> None:
    name = new_name("ctl")
    await client.create_schedule(name, "arith", every=1, input=1)
    await eventually(lambda: client.describe_schedule(name), lambda i: i.started >= 1)
    await client.pause_schedule(name)
    paused = await eventually(lambda: client.describe_schedule(name), lambda i: i.paused)
    assert paused.next_run_at is None
    await asyncio.sleep(2.5)
    still = await client.describe_schedule(name)
    assert still.started == paused.started, "a paused schedule started an instance"

    await client.trigger_schedule(name)
    triggered = await eventually(lambda: client.describe_schedule(name), lambda i: i.triggered == 1)
    assert triggered.last_instance_id is not None
    assert re.search(r"@\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", triggered.last_instance_id)
    # Published with the schedule's commit, applied on its own partition just after.
    await eventually(lambda: client.status(triggered.last_instance_id), lambda s: s.finished)
    assert await client.result(triggered.last_instance_id, timeout=20) == {"total": 2, "doubled": 4}

    await client.resume_schedule(name)
    await eventually(
        lambda: client.describe_schedule(name),
        lambda i: not i.paused and i.started >= triggered.started + 2,
    )
    await client.delete_schedule(name)
    await eventually(
        lambda: client.list_schedules(), lambda found: name not in {s.name for s in found}
    )
    with pytest.raises(UnknownInstance, match=f"no schedule named '{name}'"):
        await client.describe_schedule(name)
    for control in (client.trigger_schedule, client.pause_schedule, client.delete_schedule):
        with pytest.raises(UnknownInstance, match=f"'{name}' \\(it was deleted\\)"):
            await control(name)
    before = len(await started_ids(client, name))
    await asyncio.sleep(2.5)
    assert len(await started_ids(client, name)) == before, "a deleted schedule started one"

    # Created again, it comes back with the new spec.
    await client.create_schedule(name, "arith", every=2, input=1)
    back = await eventually(lambda: client.describe_schedule(name), lambda i: i.spec == "every 2s")
    assert not back.paused


async def test_overlap_skip_waits_for_the_running_instance(client: Client) -> None:
    name = new_name("slow")
    await client.create_schedule(name, "waiter", every=1, overlap="skip")
    info = await eventually(
        lambda: client.describe_schedule(name), lambda i: i.skipped_overlap >= 2
    )
    assert info.started == 1 and len(info.running) == 1
    first = info.running[0]
    await eventually(lambda: client.status(first), lambda s: s.status == "running")
    await client.send_event(first, "approval", "go")
    assert await client.result(first, timeout=20) == "go"
    after = await eventually(lambda: client.describe_schedule(name), lambda i: i.started >= 2)
    assert after.running and after.running[0] != first
    await client.delete_schedule(name)


async def test_overlap_buffer_one_starts_the_held_slot_when_the_last_ends(client: Client) -> None:
    name = new_name("buf")
    await client.create_schedule(name, "waiter", every=1, overlap="buffer_one")
    info = await eventually(
        lambda: client.describe_schedule(name),
        lambda i: i.buffered_slot is not None and i.skipped_overlap >= 1,
    )
    assert info.started == 1
    await eventually(lambda: client.status(info.running[0]), lambda s: s.status == "running")
    await client.send_event(info.running[0], "approval", "go")
    after = await eventually(lambda: client.describe_schedule(name), lambda i: i.started == 2)
    assert after.last_instance_id == f"{name}@{info.buffered_slot}"
    await client.delete_schedule(name)


async def test_overlap_allow_runs_them_side_by_side(client: Client) -> None:
    name = new_name("all")
    await client.create_schedule(name, "waiter", every=1, overlap="allow")
    info = await eventually(lambda: client.describe_schedule(name), lambda i: len(i.running) >= 3)
    assert info.skipped_overlap == 0
    await client.delete_schedule(name)


async def test_bad_schedules_are_refused_before_anything_is_sent(client: Client) -> None:
    with pytest.raises(InvalidPayload, match="either cron="):
        await client.create_schedule("x", "arith")
    with pytest.raises(InvalidPayload, match="not valid"):
        await client.create_schedule("x", "arith", cron="61 * * * *")
    with pytest.raises(InvalidPayload, match="at most 3153600000"):
        await client.create_schedule("x", "arith", every=10**20)
    with pytest.raises(InvalidPayload, match=r"catchup_window=.* at most"):
        await client.create_schedule("x", "arith", every=60, catchup_window=10**20)
    with pytest.raises(InvalidPayload, match="reserved for schedules"):
        await client.start("arith", 1, instance_id="~schedule/x")
    with pytest.raises(UnknownInstance, match="no schedule named 'nope'"):
        await client.pause_schedule("nope")
    with pytest.raises(UnknownInstance, match="no schedule named 'nope'"):
        await client.describe_schedule("nope")
    # A schedule of a workflow no worker has is refused as a start of it would be.
    with pytest.raises(UnknownWorkflow, match="unknown workflow 'no-such-workflow'"):
        await client.create_schedule("x", "no-such-workflow", every=60)
    with pytest.raises(UnknownInstance, match="no schedule named 'x'"):
        await client.describe_schedule("x")


async def test_a_cancelled_schedule_is_created_again(client: Client) -> None:
    """Cancelling the schedule's own instance stops it; creating the name again starts
    it afresh, and a control call meanwhile says what to do."""
    name = new_name("cancelled")
    await client.create_schedule(name, "arith", every=1, input=1)
    await eventually(lambda: client.describe_schedule(name), lambda i: i.started >= 1)
    await client.cancel(f"~schedule/{name}", reason="by hand")
    ended = await eventually(
        lambda: client.describe_schedule(name), lambda i: i.status == "cancelled"
    )
    assert ended.next_run_at is None  # it runs no slot again
    with pytest.raises(InstanceFinished, match="schedule create"):
        await client.trigger_schedule(name)
    await client.create_schedule(name, "arith", every=1, input=1)
    back = await eventually(
        lambda: client.describe_schedule(name), lambda i: i.status == "running" and i.started >= 1
    )
    assert not back.paused
