"""Queues on the embedded engine, through the public client: the limits hold (from the
recorded admission and release times), priority orders the waiters, per_key keeps keys
apart, a waiting instance shows what it waits for, a cancel gives its slot back, and a
step's queue limits its calls."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stepstream import Client, WorkflowFailed
from stepstream.engine.api.workflow import Registry
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.testing import WorkflowEnvironment
from tests.queue_checks import most_at_once, most_per_window, slot_spans


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[Client]:
    registry = Registry()
    registry.add_module("tests.queue_workflows")
    engine = await open_embedded(
        registry, EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=4)
    )
    async with Client(engine.make_transport(owns_engine=True)) as c:
        yield c


async def until_status(client: Client, instance_id: str, status: str) -> None:
    for _ in range(500):
        if (await client.status(instance_id)).status == status:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{instance_id} never got {status}: {await client.status(instance_id)}")


async def test_200_instances_never_more_than_concurrency_at_once(client: Client) -> None:
    ids = [await client.start("pooled", 0.05, instance_id=f"p-{n}") for n in range(200)]
    assert [await client.result(i, timeout=120) for i in ids] == [0.05] * 200
    spans = [s for i in ids for s in slot_spans(await client.history(i))]
    assert len(spans) == 200
    assert 1 < most_at_once(spans) <= 5


async def test_rate_admits_at_most_rate_per_window(client: Client) -> None:
    ids = [await client.start("paced", None, instance_id=f"r-{n}") for n in range(40)]
    for i in ids:
        assert await client.result(i, timeout=60) == i
    admitted = [a for i in ids for a, _ in slot_spans(await client.history(i))]
    assert most_per_window(admitted, 500) <= 10
    # 40 at 10 per 0.5 s: the last window opens 1.5 s after the first.
    assert max(admitted) - min(admitted) >= 1500


async def test_waiters_go_by_priority_then_arrival_and_show_their_wait(client: Client) -> None:
    await client.start("gate", None, instance_id="holder")
    await until_status(client, "holder", "running")
    order = [("low-1", 5), ("high-1", 1), ("low-2", 5), ("default", None), ("high-2", 1)]
    for instance_id, priority in order:
        await client.start("quick", None, instance_id=instance_id, priority=priority)
    waiting = await client.status("high-2")
    assert waiting.status == "pending"
    [wait] = waiting.to_json()["waits"]
    assert wait["kind"] == "queue" and wait["queue"] == "~queue/single"
    await asyncio.sleep(0.5)  # every request has reached the queue
    ids = [i for i, _ in order]
    # Each one's status says where it stands: the order the queue will admit them in.
    places = {i: (await client.status(i)).waits[0] for i in ids}
    assert {i: (w.position, w.waiting) for i, w in places.items()} == {
        "default": (1, 5),
        "high-1": (2, 5),
        "high-2": (3, 5),
        "low-1": (4, 5),
        "low-2": (5, 5),
    }
    await client.send_event("holder", "go", None)
    for i in ids:
        assert await client.result(i, timeout=30) == i
    admitted = {i: slot_spans(await client.history(i))[0][0] for i in ids}
    assert sorted(ids, key=admitted.__getitem__) == [
        "default",
        "high-1",
        "high-2",
        "low-1",
        "low-2",
    ]


async def test_per_key_limits_each_key_apart(client: Client) -> None:
    await client.start("tenant", None, instance_id="a-1", queue_key="a")
    await client.start("tenant", None, instance_id="b-1", queue_key="b")
    await until_status(client, "a-1", "running")
    await until_status(client, "b-1", "running")  # another key: not held up by a-1
    await client.start("tenant", None, instance_id="a-2", queue_key="a")
    await asyncio.sleep(0.3)
    assert (await client.status("a-2")).status == "pending"
    assert (await client.status("a-2")).waits[0].queue == "~queue/tenants/a"
    await client.send_event("a-1", "go", None)
    await until_status(client, "a-2", "running")
    for i in ("b-1", "a-2"):
        await client.send_event(i, "go", None)
        assert await client.result(i, timeout=30) == i


async def test_cancelled_waiter_and_holder_give_their_slots_back(client: Client) -> None:
    await client.start("gate", None, instance_id="first")
    await until_status(client, "first", "running")
    await client.start("gate", None, instance_id="waiter")
    await asyncio.sleep(0.2)
    await client.cancel("waiter", reason="not needed")
    await client.start("gate", None, instance_id="second")
    await client.cancel("first", reason="done with it")  # a holder: its slot goes to "second"
    await until_status(client, "second", "running")
    await client.send_event("second", "go", None)
    assert await client.result("second", timeout=30) == "second"
    # The withdrawn waiter was never admitted, and nothing holds the one slot now.
    assert not [e for e in await client.history("waiter") if e.type == "MessagesReceived"]
    await client.start("quick", None, instance_id="after")
    assert await client.result("after", timeout=30) == "after"


async def test_a_paused_waiter_admitted_shows_it_holds_its_slot(client: Client) -> None:
    """Admitted while paused, an instance holds its slot from then on: its status says
    so, not that it still waits, and it runs once resumed. An event a paused instance's
    wait was sent shows the same way."""
    await client.start("gate", None, instance_id="holder")
    await until_status(client, "holder", "running")
    await client.start("quick", None, instance_id="next")
    await asyncio.sleep(0.3)  # its request has reached the queue
    assert (await client.status("next")).waits[0].position == 1
    await client.pause("next")
    await client.send_event("holder", "go", None)
    assert await client.result("holder", timeout=30) == "holder"
    for _ in range(500):
        [wait] = (await client.status("next")).waits
        if wait.state != "waiting":
            break
        await asyncio.sleep(0.02)
    assert (wait.kind, wait.state, wait.queue, wait.position) == (
        "queue",
        "admitted",
        "~queue/single",
        None,
    )
    paused = await client.status("next")
    assert paused.status == "paused" and paused.buffered_events == 1
    await client.resume("next")
    assert await client.result("next", timeout=30) == "next"

    await client.start("gate", None, instance_id="gated")  # the slot is free again
    await until_status(client, "gated", "running")
    await client.pause("gated")
    await client.send_event("gated", "go", None)
    [wait] = (await client.status("gated")).waits
    assert (wait.kind, wait.state, wait.event) == ("wait", "received", "go")
    await client.resume("gated")
    assert await client.result("gated", timeout=30) == "gated"


async def test_a_waiter_paused_and_resumed_is_pending_until_admitted(client: Client) -> None:
    """A resume gives an instance back the status it had: one its queue has not
    admitted is pending (what a list of the backlog filters on), not running."""
    await client.start("gate", None, instance_id="holds")
    await until_status(client, "holds", "running")
    await client.start("gate", None, instance_id="behind")
    await asyncio.sleep(0.3)  # its request has reached the queue
    await client.pause("behind")
    await client.resume("behind")
    behind = await client.status("behind")
    assert behind.status == "pending", behind
    assert [(w.kind, w.state) for w in behind.waits] == [("queue", "waiting")]
    assert "behind" in [i.instance_id for i in await client.list(status="pending")]
    await client.send_event("holds", "go", None)
    await until_status(client, "behind", "running")
    await client.send_event("behind", "go", None)
    assert await client.result("behind", timeout=30) == "behind"


async def test_a_paused_instance_shows_received_only_for_the_waits_that_get_an_event(
    client: Client,
) -> None:
    """One event goes to one wait (the oldest for its name); a wait with a timeout may
    time out before the instance resumes, so it still shows waiting."""
    await client.start("two-gates", None, instance_id="two")
    await until_status(client, "two", "running")
    await client.pause("two")
    await client.send_event("two", "go", "first")
    states = [(w.key, w.state) for w in (await client.status("two")).waits]
    assert states == [("go-a", "received"), ("go-b", "waiting")], states
    await client.resume("two")
    await client.send_event("two", "go", "second")
    assert await client.result("two", timeout=30) == ["first", "second"]

    await client.start("timed-gate", 30, instance_id="timed")
    await until_status(client, "timed", "running")
    await client.pause("timed")
    await client.send_event("timed", "go", "in time")
    [wait] = (await client.status("timed")).waits
    assert (wait.state, wait.until is not None) == ("waiting", True)
    await client.resume("timed")
    assert await client.result("timed", timeout=30) == "in time"


async def test_a_step_queue_limits_its_calls_across_instances(client: Client) -> None:
    ids = [await client.start("calls", 6, instance_id=f"c-{n}") for n in range(8)]
    for i in ids:
        assert await client.result(i, timeout=60) == [0.03] * 6
    spans = [s for i in ids for s in slot_spans(await client.history(i), "#slot")]
    assert len(spans) == 48
    assert 1 < most_at_once(spans) <= 2


async def test_a_queued_step_whose_answer_would_be_too_long_fails_alone(client: Client) -> None:
    """The queue answers a step under a name made of the step's: a step name too long
    for it fails its own instance, and the queue goes on admitting the others."""
    await client.start("long-named-call", 200, instance_id="short")
    assert await client.result("short", timeout=30) == 0
    await client.start("long-named-call", 240, instance_id="long")
    with pytest.raises(WorkflowFailed, match="queue 'api' cannot admit it"):
        await client.result("long", timeout=30)
    await client.start("calls", 2, instance_id="after")
    assert await client.result("after", timeout=30) == [0.03] * 2
    assert (await client.status("~queue/api")).status == "running"


async def test_a_step_backing_off_gives_its_slot_to_another_instance(
    client: Client, tmp_path: Path
) -> None:
    ledger = str(tmp_path / "ledger")
    await client.start("partner", {"ledger": ledger, "fail_first": True}, instance_id="slow")
    for _ in range(500):  # its first attempt failed: it backs off for 1.5 s
        if Path(ledger).exists():
            break
        await asyncio.sleep(0.02)
    await client.start("partner", {"ledger": ledger}, instance_id="other")
    assert await client.result("other", timeout=30) == "other"
    assert await client.result("slow", timeout=30) == "slow"
    rows = [json.loads(line) for line in Path(ledger).read_text().splitlines()]
    calls = {(r["name"], r["attempt"]): r for r in rows}
    assert sorted(calls) == [("other", 1), ("slow", 1), ("slow", 2)], rows
    # "other" ran while "slow" backed off: after its failed attempt, before its retry.
    assert calls["slow", 1]["end"] <= calls["other", 1]["start"], rows
    assert calls["other", 1]["end"] <= calls["slow", 2]["start"], rows
    slow = await client.history("slow")
    spans = [s for i in ("slow", "other") for s in slot_spans(await client.history(i), "#slot")]
    assert len(spans) == 3 and most_at_once(spans) == 1, slow
    # Each attempt asked for its own slot, and the backoff was waited out holding none.
    keys = [e.attributes.get("key") for e in slow if e.type in ("MessageSent", "SleepStarted")]
    assert keys == [
        "call#slot#acquire",
        "call#slot#release",
        "call#backoff#1",
        "call#slot#2#acquire",
        "call#slot#2#release",
    ], slow


async def test_a_restarted_run_asks_its_queue_afresh(client: Client) -> None:
    await client.start("picky", "bad", instance_id="pk")
    with pytest.raises(WorkflowFailed):
        await client.result("pk", timeout=30)
    await client.start("picky", "good", instance_id="pk", if_exists="restart_if_failed")
    assert await client.result("pk", timeout=30) == "good"
    await client.start("quick", None, instance_id="after")  # nothing kept the one slot
    assert await client.result("after", timeout=30) == "after"


async def test_reset_retry_and_fork_of_a_queued_workflow_ask_its_queue_again(
    client: Client, tmp_path: Path
) -> None:
    """A run that goes on after its slot was given back (its end released it) or that
    is not its own (a fork's copy) waits for the queue again, like a new start: it runs
    nothing beside the holder the limit allows, and gives its new slot back."""
    ledger = tmp_path / "ledger"
    await client.start("fails-once", str(ledger), instance_id="failed")
    with pytest.raises(WorkflowFailed):
        await client.result("failed", timeout=30)
    await client.start("two-steps", str(ledger), instance_id="done")
    assert await client.result("done", timeout=30) == ["done/first", "done/second"]
    await client.start("gate", None, instance_id="holder")  # the one slot of "single"
    await until_status(client, "holder", "running")

    went_on = time.time() * 1000
    await client.retry("failed")
    await client.fork("done", to="second", instance_id="forked")
    await client.reset("done", to="second")
    await asyncio.sleep(0.5)
    for instance_id in ("failed", "done", "forked"):
        status = await client.status(instance_id)
        assert [(w.kind, w.queue) for w in status.waits] == [("queue", "~queue/single")], status
    await client.send_event("holder", "go", None)
    assert await client.result("failed", timeout=30) == "failed"
    assert await client.result("done", timeout=30) == ["done/first", "done/second"]
    assert await client.result("forked", timeout=30) == ["done/first", "forked/second"]

    released = max(s[1] for s in slot_spans(await client.history("holder")))
    rows = [json.loads(line) for line in ledger.read_text().splitlines()]
    again = [r for r in rows if r["start"] > went_on]
    assert sorted(r["name"] for r in again) == ["done/second", "failed", "forked/second"]
    assert all(r["start"] >= released for r in again), (released, again)
    # One at a time: the new admissions and releases of the instances gone on.
    spans = [s for i in ("holder", "failed", "done") for s in slot_spans(await client.history(i))]
    assert most_at_once(spans) == 1, spans
    await client.start("quick", None, instance_id="after")  # no slot was kept
    assert await client.result("after", timeout=30) == "after"


@pytest.mark.parametrize("seed", range(6))
async def test_a_queued_step_with_retries_ends_the_same_across_crashes(
    seed: int, tmp_path: Path
) -> None:
    rng = random.Random(seed)
    ledger = str(tmp_path / "ledger")
    async with WorkflowEnvironment("tests.queue_workflows", partitions=2) as env:
        args = {"ledger": ledger, "fail_first": True}
        await env.client.start("partner", args, instance_id="slow")
        await env.client.start("partner", {"ledger": ledger}, instance_id="other")
        await env.crash(after_writes=rng.randint(0, 8))
        await env.advance(1)
        await env.crash(after_writes=rng.randint(0, 4))
        await env.advance(2)
        assert await env.client.result("slow", timeout=30) == "slow"
        assert await env.client.result("other", timeout=30) == "other"
        slow = await env.client.history("slow")
    assert [e.type for e in slow].count("StepSucceeded") == 1, slow
    # Every attempt ran in a slot of its own, admitted before it started and given back.
    attempts = [e.attributes["attempt"] for e in slow if e.type == "StepAttemptStarted"]
    assert len(slot_spans(slow, "#slot")) == len(attempts) >= 2, slow
    # The retry came after a backoff waited out holding no slot, whatever was lost.
    keys = [e.attributes.get("key") for e in slow if e.type == "SleepStarted"]
    assert keys and all(k.startswith("call#backoff#") for k in keys), slow


async def test_a_retry_of_code_that_raised_asks_its_queue_again(
    client: Client, tmp_path: Path
) -> None:
    """The code raised (no step failed), giving its slot back as the exception went up:
    retried once a fix is deployed, it waits for the queue and runs on."""
    args = {"ledger": str(tmp_path / "ledger"), "fixed": str(tmp_path / "fixed")}
    await client.start("code-fails", args, instance_id="cf")
    with pytest.raises(WorkflowFailed, match="a bug in the code"):
        await client.result("cf", timeout=30)
    await client.start("gate", None, instance_id="holder")
    await until_status(client, "holder", "running")
    (tmp_path / "fixed").touch()
    await client.retry("cf")
    await asyncio.sleep(0.5)
    assert [w.kind for w in (await client.status("cf")).waits] == ["queue"]
    await client.send_event("holder", "go", None)
    assert await client.result("cf", timeout=30) == ["cf/first", "cf/second"]
    spans = [s for i in ("holder", "cf") for s in slot_spans(await client.history(i))]
    assert most_at_once(spans) == 1, spans


@pytest.mark.parametrize("key", ["call#backoff#1", "call#slot#2", "call#slot#2#acquire"])
async def test_a_queued_step_reset_between_its_attempts_runs_on(
    client: Client, tmp_path: Path, key: str
) -> None:
    """Reset to a key between a queued step's failed attempt and its retry: the failed
    attempt replays, and the retry asks for a slot of its own and runs."""
    ledger = tmp_path / "ledger"
    await client.start("partner", {"ledger": str(ledger), "fail_first": True}, instance_id="p")
    assert await client.result("p", timeout=30) == "p"
    await client.reset("p", to=key)
    assert await client.result("p", timeout=30) == "p"
    history = await client.history("p")
    attempts = [e.attributes["attempt"] for e in history if e.type == "StepAttemptStarted"]
    assert attempts == [1, 2, 3], history  # the set-aside second, then a third
    assert len(ledger.read_text().splitlines()) == 3
    await client.start("partner", {"ledger": str(ledger)}, instance_id="after")
    assert await client.result("after", timeout=30) == "after"  # no slot was kept


@pytest.mark.parametrize("seed", range(4))
async def test_a_run_asking_its_queue_again_ends_the_same_across_crashes(
    seed: int, tmp_path: Path
) -> None:
    rng = random.Random(seed)
    ledger = tmp_path / "ledger"
    async with WorkflowEnvironment("tests.queue_workflows", partitions=2) as env:
        await env.client.start("two-steps", str(ledger), instance_id="d")
        assert await env.client.result("d", timeout=30) == ["d/first", "d/second"]
        await env.client.start("gate", None, instance_id="holder")
        await until_status(env.client, "holder", "running")
        await env.client.reset("d", to="second")
        await env.crash(after_writes=rng.randint(0, 4))
        assert (await env.client.status("d")).waits[0].kind == "queue"
        await env.client.send_event("holder", "go", None)
        await env.crash(after_writes=rng.randint(0, 6))
        assert await env.client.result("d", timeout=30) == ["d/first", "d/second"]
        await env.client.start("quick", None, instance_id="after")  # no slot was kept
        assert await env.client.result("after", timeout=30) == "after"
        history = await env.client.history("d")
    rows = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [r["name"] for r in rows] == ["d/first", "d/second", "d/second"]
    asks = [e.attributes["key"] for e in history if e.type == "MessageSent" and not e.set_aside]
    assert asks == ["queue#acquire", "queue#ask2#acquire", "queue#ask2#release"], history
