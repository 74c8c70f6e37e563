"""``stepstream.testing.WorkflowEnvironment``: an embedded engine with a virtual clock.

Long timers take no wall time, ``advance`` fires them at their own times and in order,
and ``crash`` restarts the engine from its data directory as after kill -9: at chosen
points and at seeded random ones, every instance ends as it does without a crash, and no
step succeeds twice in its history.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from stepstream import Context, InvalidPayload, WorkflowFailed, workflow
from stepstream.engine.api.retry import RetryPolicy
from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import EventTimeout, StepstreamError
from stepstream.testing import VirtualClock, WorkflowEnvironment

DAY = 86400
START = datetime(2024, 1, 1, tzinfo=UTC)
FOREVER = RetryPolicy(max_attempts=None, initial_interval=1.0)


def bill(customer: str, n: int) -> str:
    return f"billed {customer} #{n}"


async def slowly(value: int) -> int:
    await asyncio.sleep(0.002)  # long enough for a crash to land while it runs
    return value * 10


@workflow("subscription")
async def subscription(ctx: Context, customer: str) -> dict[str, Any]:
    started = ctx.now()
    await ctx.sleep("trial", 30 * DAY)
    first = await ctx.step("bill", bill, customer, 1)
    try:
        renewal = await ctx.wait_for_event("renew", timeout=7 * DAY)
    except EventTimeout:
        renewal = None
    return {
        "first": first,
        "renewal": renewal,
        "days": (ctx.now() - started).total_seconds() / DAY,
    }


@workflow("ticks")
async def ticks(ctx: Context, days: list[int]) -> list[str]:
    seen = []
    for n, day in enumerate(days):
        await ctx.sleep(f"tick-{n}", day * DAY)
        seen.append(ctx.now().isoformat())
    return seen


@workflow("pipeline")
async def pipeline(ctx: Context, n: int) -> dict[str, Any]:
    a, b = await asyncio.gather(
        ctx.step("a", slowly, n, retry=FOREVER), ctx.step("b", slowly, n + 1, retry=FOREVER)
    )
    await ctx.sleep("settle", 3600)
    c = await ctx.step("c", slowly, a + b, retry=FOREVER)
    go = await ctx.wait_for_event("go", timeout=DAY)
    d = await ctx.step("d", slowly, c + go, retry=FOREVER)
    return {"a": a, "b": b, "c": c, "d": d}


_failures: dict[str, int] = {}


def fails_once(key: str) -> str:
    _failures[key] = _failures.get(key, 0) + 1
    if _failures[key] == 1:
        raise RuntimeError("first attempt fails")
    return "ok"


@workflow("retrying")
async def retrying(ctx: Context, key: str) -> str:
    return await ctx.step(
        "flaky", fails_once, key, retry=RetryPolicy(max_attempts=3, initial_interval=5.0)
    )


async def stuck() -> None:
    await asyncio.sleep(30)


@workflow("stuck")
async def stuck_workflow(ctx: Context, _: Any) -> None:
    await ctx.step("forever", stuck)


ALL = [subscription, ticks, pipeline, retrying, stuck_workflow]


async def test_a_30_day_sleep_and_a_7_day_timeout_take_no_wall_time() -> None:
    began = time.monotonic()
    async with WorkflowEnvironment(ALL, clock="virtual", start=START) as env:
        await env.client.start("subscription", "ada", instance_id="s-1")
        await env.settle()
        (trial,) = (await env.client.status("s-1")).waits
        assert (trial.key, trial.until) == ("trial", "2024-01-31T00:00:00.000+00:00")

        await env.advance(30 * DAY)
        (wait,) = (await env.client.status("s-1")).waits
        assert (wait.key, wait.until) == ("renew", "2024-02-07T00:00:00.000+00:00")
        await env.advance(7 * DAY)
        result = await env.client.result("s-1", timeout=5)
        assert env.now() == datetime(2024, 2, 7, tzinfo=UTC)
    assert result == {"first": "billed ada #1", "renewal": None, "days": 37.0}
    assert time.monotonic() - began < 1.0


async def test_an_event_before_the_timeout_is_what_the_workflow_gets() -> None:
    async with WorkflowEnvironment([subscription], start=START) as env:
        await env.client.start("subscription", "bo", instance_id="s-2")
        await env.advance(31 * DAY)
        await env.client.send_event("s-2", "renew", {"plan": "yearly"})
        assert await env.client.result("s-2", timeout=5) == {
            "first": "billed bo #1",
            "renewal": {"plan": "yearly"},
            "days": 31.0,
        }


async def test_one_long_advance_fires_every_timer_at_its_own_time() -> None:
    async with WorkflowEnvironment([ticks], start=START) as env:
        await env.client.start("ticks", [1, 2, 30], instance_id="t-1")
        await env.advance(365 * DAY)
        assert await env.client.result("t-1", timeout=5) == [
            "2024-01-02T00:00:00+00:00",
            "2024-01-04T00:00:00+00:00",
            "2024-02-03T00:00:00+00:00",
        ]
        assert env.now() == datetime(2024, 12, 31, tzinfo=UTC)


async def test_a_retry_waits_for_its_backoff_in_virtual_time() -> None:
    async with WorkflowEnvironment([retrying], start=START) as env:
        await env.client.start("retrying", "r-1", instance_id="r-1")
        await env.settle()
        (flaky,) = (await env.client.status("r-1")).waits
        assert (flaky.state, flaky.attempt) == ("backoff", 1)
        await env.advance(4.9)
        assert not (await env.client.status("r-1")).finished
        await env.advance(0.1)
        assert await env.client.result("r-1", timeout=5) == "ok"


async def reference(inputs: list[int]) -> dict[str, Any]:
    """What the pipeline instances end with when nothing crashes."""
    async with WorkflowEnvironment([pipeline], start=START) as env:
        return await drive(env, inputs, lambda _: asyncio.sleep(0))


async def drive(env: WorkflowEnvironment, inputs: list[int], chaos: Any) -> dict[str, Any]:
    for n in inputs:
        await env.client.start("pipeline", n, instance_id=f"p-{n}")
    await chaos("started")
    await env.advance(3600)
    await chaos("slept")
    for n in inputs:
        await env.client.send_event(f"p-{n}", "go", n)
    await chaos("sent")
    await env.settle()
    results = {f"p-{n}": await env.client.result(f"p-{n}", timeout=10) for n in inputs}
    for n in inputs:
        succeeded = [
            e.attributes["key"]
            for e in await env.client.history(f"p-{n}")
            if e.type == "StepSucceeded"
        ]
        assert sorted(succeeded) == ["a", "b", "c", "d"], f"p-{n}: {succeeded}"
    return results


@pytest.mark.parametrize("point", ["started", "slept", "sent"])
async def test_a_crash_at_a_chosen_point_ends_the_same(point: str) -> None:
    inputs = [1, 2, 3]
    expected = await reference(inputs)

    async with WorkflowEnvironment([pipeline], start=START) as env:

        async def chaos(where: str) -> None:
            if where == point:
                await env.crash()

        assert await drive(env, inputs, chaos) == expected
        assert env.crashes == 1


def random_crashes(env: WorkflowEnvironment, rng: random.Random) -> Any:
    """At each point: up to two crashes, each after a random number of commits."""

    async def chaos(_: str) -> None:
        for _ in range(rng.randint(0, 2)):
            await env.crash(after_writes=rng.randint(0, 6))

    return chaos


async def test_crashes_at_seeded_random_points_end_the_same() -> None:
    inputs = [1, 2, 3, 4]
    expected = await reference(inputs)
    lost = 0
    for seed in range(10):
        async with WorkflowEnvironment([pipeline], start=START) as env:
            chaos = random_crashes(env, random.Random(seed))
            assert await drive(env, inputs, chaos) == expected, f"seed {seed}"
            for n in inputs:
                history = await env.client.history(f"p-{n}")
                lost += sum(
                    1
                    for e in history
                    if e.type == "StepFailed" and e.attributes["error_type"] == "AttemptLost"
                )
    assert lost > 0, "no crash landed while a step attempt ran: the test lost its point"


async def test_a_result_awaited_across_a_crash_still_arrives() -> None:
    async with WorkflowEnvironment([subscription], start=START) as env:
        await env.client.start("subscription", "cy", instance_id="s-3")
        waiting = asyncio.ensure_future(env.client.result("s-3", timeout=10))
        await env.settle()
        await env.crash()
        await env.advance(37 * DAY)
        assert (await waiting)["first"] == "billed cy #1"


async def test_workflows_may_be_functions_modules_names_or_a_registry() -> None:
    module = sys.modules[__name__]
    for given in ([subscription], subscription, module, __name__, Registry([subscription])):
        async with WorkflowEnvironment(given) as env:
            await env.client.start("subscription", "d", instance_id="s")
            await env.advance(40 * DAY)
            assert (await env.client.result("s", timeout=5))["days"] == 37.0


async def test_something_that_is_not_a_workflow_is_refused_saying_what_to_pass() -> None:
    with pytest.raises(TypeError, match="42 is not a workflow: pass @workflow functions"):
        WorkflowEnvironment(42)  # type: ignore[arg-type]


async def test_an_environment_that_is_not_running_says_so_instead_of_waiting() -> None:
    env = WorkflowEnvironment([subscription])
    for call in (env.settle(), env.advance(1)):
        with pytest.raises(StepstreamError, match=r"needs a running environment: use `async with"):
            await asyncio.wait_for(call, 5)
    async with env:
        client = env.client
        await client.start("subscription", "d", instance_id="s")
    for call in (env.settle(), env.advance(1)):
        with pytest.raises(StepstreamError, match="needs a running environment"):
            await asyncio.wait_for(call, 5)
    with pytest.raises(StepstreamError, match=r"environment is not running \(not started, or"):
        await asyncio.wait_for(client.status("s"), 5)


async def test_the_system_clock_runs_in_real_time_and_cannot_be_advanced() -> None:
    async with WorkflowEnvironment([ticks], clock="system") as env:
        with pytest.raises(StepstreamError, match="clock='virtual'"):
            await env.advance(1)
        await env.client.start("ticks", [0], instance_id="t")
        assert len(await env.client.result("t", timeout=5)) == 1


async def test_settle_names_what_keeps_the_engine_busy() -> None:
    async with WorkflowEnvironment([stuck_workflow], settle_timeout=0.3) as env:
        await env.client.start("stuck", None, instance_id="x")
        with pytest.raises(StepstreamError, match="step 'forever' of instance x is running"):
            await env.advance(1)


async def test_a_virtual_clock_given_as_an_object_is_the_engines() -> None:
    clock = VirtualClock(round(START.timestamp() * 1000))
    async with WorkflowEnvironment([ticks], clock=clock) as env:
        await env.client.start("ticks", [2], instance_id="t")
        clock.advance(DAY)  # moved by hand: the engine sees it, the timer is not due yet
        await env.advance(DAY)
        assert await env.client.result("t", timeout=5) == ["2024-01-03T00:00:00+00:00"]


async def test_long_sleepers_leave_memory_and_wake_where_they_slept() -> None:
    """An instance whose only business is a long sleep is not held in memory (every full
    garbage collection would walk it); its timer brings it back, replayed, on time."""
    async with WorkflowEnvironment([ticks], start=START) as env:
        for n in range(50):
            await env.client.start("ticks", [2, 1], instance_id=f"sleeper-{n}")
        await env.settle()
        assert sum(g.cached_instances for g in env.engine.host.gauges()) == 0
        await env.advance(3 * DAY)
        for n in range(50):
            assert await env.client.result(f"sleeper-{n}", timeout=5) == [
                "2024-01-03T00:00:00+00:00",
                "2024-01-04T00:00:00+00:00",
            ]


@workflow("inbox")
async def inbox(ctx: Context, _: Any) -> str:
    try:
        await ctx.messages.next(["order", "refund"], timeout=DAY)
    except EventTimeout as exc:
        return str(exc)
    return "a message came"


async def test_a_message_wait_that_times_out_names_the_messages_it_waited_for() -> None:
    async with WorkflowEnvironment(Registry([inbox]), clock="virtual") as env:
        await env.client.start("inbox", None, instance_id="in-1")
        await env.advance(2 * DAY)
        said = await env.client.result("in-1")
    assert said == (
        "instance in-1: no message 'order' or 'refund' arrived before the timeout of "
        "wait 'messages'"
    ), said


@workflow("collector")
async def collector(ctx: Context, count: int) -> list[Any]:
    got: list[Any] = []
    while len(got) < count:
        got.extend(m.payload for m in await ctx.messages.next_batch("m", max=5))
    return got


async def test_messages_held_while_paused_are_taken_in_order_after_a_crash() -> None:
    """A message wait keeps how many it takes across a reload of its instance: what came
    while it was paused is taken after a crash and the resume, before what comes later."""
    async with WorkflowEnvironment(Registry([collector]), clock="virtual") as env:
        await env.client.start("collector", 3, instance_id="col")
        await env.settle()
        await env.client.pause("col")
        for payload in ("first", "second"):
            await env.client.send_event("col", "m", payload)
        await env.settle()
        await env.crash()
        await env.client.resume("col")
        await env.settle()
        await env.client.send_event("col", "m", "third")
        assert await env.client.result("col", timeout=10) == ["first", "second", "third"]


@workflow("takes")
async def takes(ctx: Context, names: Any) -> list[Any]:
    return [m.payload for m in await ctx.messages.next_batch(names, max=5, timeout=0)]


@pytest.mark.parametrize(
    ("names", "says"),
    [
        (5, "give a message name or a list of them, not int 5"),
        (None, "give a message name or a list of them, not NoneType"),
        (["ok", 5], "message name 5 must be a string, not int"),
        ("~x", "message name '~x' starts with '~'"),
        (["ok", ""], "message name '' must not be empty"),
    ],
)
async def test_names_no_client_can_send_are_refused_where_the_code_waits(
    names: Any, says: str
) -> None:
    async with WorkflowEnvironment(Registry([takes]), clock="virtual") as env:
        await env.client.start("takes", names, instance_id="t-1")
        with pytest.raises(WorkflowFailed, match=re.escape(f"ctx.messages.next_batch: {says}")):
            await env.client.result("t-1")


@workflow("answers")
async def answers(ctx: Context, target: str) -> str:
    msg = await ctx.messages.next("a/b")  # any name a client may send
    await msg.complete("first")
    await msg.complete("second")  # changes nothing
    try:
        await ctx.messages.send(target, "hello", None)
    except StepstreamError as exc:
        return str(exc)
    return "sent"


async def test_a_message_answered_twice_keeps_its_first_answer() -> None:
    async with WorkflowEnvironment(Registry([answers]), clock="virtual") as env:
        await env.client.start("answers", "", instance_id="a-1")
        assert await env.client.request("a-1", "a/b", None, timeout=10) == "first"
        # A bad send says which of its arguments is wrong.
        assert await env.client.result("a-1") == (
            "message 'send' of a-1: the instance id it goes to, '', must not be empty or "
            "only spaces"
        )


async def test_a_bad_request_timeout_is_refused_before_the_message_goes() -> None:
    async with WorkflowEnvironment(Registry([answers]), clock="virtual") as env:
        await env.client.start("answers", "x", instance_id="a-2")
        for timeout in ("5", math.nan, -1):
            with pytest.raises(InvalidPayload, match="give a number of seconds"):
                await env.client.request("a-2", "a/b", None, timeout=timeout)  # type: ignore[arg-type]
            with pytest.raises(InvalidPayload, match="give a number of seconds"):
                await env.client.result("a-2", timeout=timeout)  # type: ignore[arg-type]
        assert (await env.client.status("a-2")).buffered_events == 0  # none was sent
        assert await env.client.request("a-2", "a/b", None, timeout=math.inf) == "first"


AUDITING = threading.Event()


def slow_audit(x: int) -> str:
    AUDITING.set()
    time.sleep(2)
    return "audited"


async def test_calls_the_code_removed_while_open_are_abandoned(tmp_path: Path) -> None:
    """ctx.removed on a step whose attempt was running and a sleep still sleeping when
    the code changed: both are abandoned (recorded), so no status shows them open and
    the environment settles; the instance goes on."""

    @workflow("audited", version="1")
    async def audited_v1(ctx: Context, slow: bool) -> Any:
        if slow:
            await ctx.step("audit", slow_audit, 1)
        await ctx.sleep("cool", 3600)
        return await ctx.wait_for_event("go")

    @workflow("audited", version="1")
    async def audited_v1_without(ctx: Context, slow: bool) -> Any:
        ctx.removed("audit")
        ctx.removed("cool")
        return await ctx.wait_for_event("go")

    data = tmp_path / "data"
    async with WorkflowEnvironment(Registry([audited_v1]), data_dir=data) as env:
        await env.client.start("audited", True, instance_id="slow")
        await env.client.start("audited", False, instance_id="sleepy")
        await asyncio.get_running_loop().run_in_executor(None, AUDITING.wait, 10)
    async with WorkflowEnvironment(Registry([audited_v1_without]), data_dir=data) as env:
        await env.settle()
        for instance in ("slow", "sleepy"):
            status = await env.client.status(instance)
            assert [(w.kind, w.key) for w in status.waits] == [("wait", "go")], status
            await env.client.send_event(instance, "go", instance)
            assert await env.client.result(instance, timeout=10) == instance
        history = await env.client.history("slow")
    removed = [e.attributes["key"] for e in history if e.type == "CallRemoved"]
    assert removed == ["audit"], history
    assert "StepSucceeded" not in [e.type for e in history]  # its outcome was ignored


def _looked_up() -> str:
    time.sleep(0.2)  # a slow lookup: settle must not return while it runs
    return "value"


@workflow("ephemeral-then-wait")
async def ephemeral_then_wait(ctx: Context, ephemeral: bool) -> Any:
    await ctx.step("lookup", _looked_up, ephemeral=ephemeral)
    return await ctx.wait_for_event("go")


@pytest.mark.parametrize("ephemeral", [False, True])
async def test_settle_waits_for_a_step_that_records_nothing_until_it_ends(
    ephemeral: bool,
) -> None:
    """An ephemeral step writes nothing until its outcome: settle still waits for it,
    so what the test reads next is what the code did after the step."""
    async with WorkflowEnvironment([ephemeral_then_wait], clock="virtual") as env:
        await env.client.start("ephemeral-then-wait", ephemeral, instance_id="e-1")
        await env.settle()
        status = await env.client.status("e-1")
        assert [w.key for w in status.waits] == ["go"], status
        await env.client.send_event("e-1", "go", 7)
        await env.advance(1)
        assert await env.client.result("e-1", timeout=5) == 7
