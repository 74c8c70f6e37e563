"""Workflows used by the test suite (importable by worker subprocesses too).

Side effects of step bodies are counted in files under $STEPSTREAM_TEST_LEDGER, so a test
in another process can see how many times a body really ran."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import datetime, timedelta
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import Any

from stepstream import (
    Context,
    EventTimeout,
    NonRetryableError,
    RetryPolicy,
    StepFailed,
    workflow,
)


def ledger(name: str) -> None:
    root = os.environ.get("STEPSTREAM_TEST_LEDGER")
    if root:
        with open(Path(root) / name, "a") as f:
            f.write("x\n")
            f.flush()
            os.fsync(f.fileno())


def ledger_count(root: Path, name: str) -> int:
    path = root / name
    return len(path.read_text().splitlines()) if path.exists() else 0


def add(a: int, b: int) -> int:
    return a + b


async def async_double(x: int) -> int:
    await asyncio.sleep(0)
    return x * 2


@workflow("arith")
async def arith(ctx: Context, n: int) -> dict[str, int]:
    total = await ctx.step("add", add, n, 1)
    doubled = await ctx.step("double", async_double, total)
    return {"total": total, "doubled": doubled}


@workflow("chain")
async def chain(ctx: Context, n: int) -> int:
    value = 0
    for i in range(n):
        value = await ctx.step(f"s{i}", add, value, 1)
    return value


_flaky_calls: dict[str, int] = {}


def flaky(key: str, fail_times: int) -> str:
    _flaky_calls[key] = _flaky_calls.get(key, 0) + 1
    ledger(f"flaky-{key}")
    if _flaky_calls[key] <= fail_times:
        raise RuntimeError(f"transient failure {_flaky_calls[key]}")
    return f"ok after {_flaky_calls[key]}"


@workflow("retrying")
async def retrying(ctx: Context, args: dict[str, Any]) -> str:
    policy = RetryPolicy(max_attempts=args["max"], initial_interval=0.01, backoff=2.0)
    try:
        return await ctx.step("flaky", flaky, args["key"], args["fail"], retry=policy)
    except StepFailed as exc:
        # compensation path: the workflow handles the failure
        return f"compensated: {exc.attempts} attempts, {exc.error_type}"


def fatal() -> None:
    raise NonRetryableError("card declined")


@workflow("fatal")
async def fatal_wf(ctx: Context, _: Any) -> None:
    await ctx.step("charge", fatal, retry=RetryPolicy(max_attempts=5, initial_interval=0.01))


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


@workflow("fail-beside-slow")
async def fail_beside_slow(ctx: Context, seconds: float) -> Any:
    """A step fails the run at once while another, slow one still runs."""
    return await asyncio.gather(ctx.step("charge", fatal), ctx.step("slow", slow, seconds))


@workflow("timeout")
async def timeout_wf(ctx: Context, seconds: float) -> str:
    return await ctx.step(
        "slow", slow, seconds, timeout=0.05, retry=RetryPolicy(max_attempts=2, initial_interval=0)
    )


@workflow("sleeper")
async def sleeper(ctx: Context, seconds: float) -> dict[str, float]:
    before = ctx.now()
    await ctx.sleep("nap", timedelta(seconds=seconds))
    after = ctx.now()
    return {"slept": (after - before).total_seconds()}


@workflow("started-clock")
async def started_clock(ctx: Context, seconds: float) -> dict[str, int]:
    """When its clock began (``ctx.now()`` before anything else) and when it woke."""
    began = ctx.now()
    await ctx.sleep("nap", seconds)
    return {"began_ms": _ms(began), "woke_ms": _ms(ctx.now())}


def _ms(at: datetime) -> int:
    return round(at.timestamp() * 1000)


@workflow("sleep-until")
async def sleep_until_wf(ctx: Context, seconds: float) -> str:
    target = ctx.now() + timedelta(seconds=seconds)
    await ctx.sleep_until("until", target)
    return "woke" if ctx.now() >= target else "early"


@workflow("waiter")
async def waiter(ctx: Context, timeout: float | None) -> Any:
    try:
        return await ctx.wait_for_event("approval", timeout=timeout)
    except EventTimeout:
        return "timed out"


@workflow("two-events")
async def two_events(ctx: Context, _: Any) -> list[Any]:
    first = await ctx.wait_for_event("item", key="item-1")
    second = await ctx.wait_for_event("item", key="item-2")
    return [first, second]


@workflow("parallel")
async def parallel(ctx: Context, n: int) -> list[int]:
    return list(await asyncio.gather(*(ctx.step(f"p{i}", add, i, 100) for i in range(n))))


@workflow("sleep-beside-a-step")
async def sleep_beside_a_step(ctx: Context, seconds: float) -> list[Any]:
    """A sleep still open while a step beside it ends: a reset to the step arms the
    sleep's timer again."""
    return list(await asyncio.gather(ctx.sleep("nap", seconds), ctx.step("b", add, 1, 2)))


@workflow("values")
async def values(ctx: Context, _: Any) -> dict[str, Any]:
    now = ctx.now()
    ident = ctx.uuid()
    rnd = ctx.random()
    await ctx.sleep("tick", 0.01)
    return {"now": now.isoformat(), "uuid": str(ident), "random": rnd}


@workflow("reuse")
async def reuse(ctx: Context, n: int) -> list[Any]:
    out: list[Any] = []
    for i in range(n):
        out.append(await ctx.step("same", add, i, 1))
        out.append(await ctx.wait_for_event("item"))
    async with ctx.scope("tail"):
        out.append(await ctx.step("same", add, 100, 1))
    return out


class Unencodable:
    pass


def bad_result() -> Unencodable:
    return Unencodable()


@workflow("bad-result")
async def bad_result_wf(ctx: Context, _: Any) -> Any:
    return await ctx.step("bad", bad_result)


@workflow("boom")
async def boom(ctx: Context, _: Any) -> None:
    await ctx.step("ok", add, 1, 1)
    raise ValueError("workflow code raised")


def record_body(name: str) -> str:
    ledger(name)
    return name


@workflow("gated")
async def gated(ctx: Context, name: str) -> list[str]:
    """Steps around a wait: used by pause/resume and crash tests."""
    a = await ctx.step("before", record_body, f"{name}-before")
    event = await ctx.wait_for_event("go")
    b = await ctx.step("after", record_body, f"{name}-after")
    return [a, str(event), b]


def crash_window(name: str, seconds: float) -> str:
    ledger(f"{name}-started")
    time.sleep(seconds)
    ledger(f"{name}-finished")
    return name


@workflow("long-step")
async def long_step(ctx: Context, args: dict[str, Any]) -> str:
    """A step that takes long enough to be killed in the middle of."""
    policy = RetryPolicy(max_attempts=args.get("max", 3), initial_interval=0.01)
    result: str = await ctx.step("long", crash_window, args["name"], args["seconds"], retry=policy)
    await ctx.step("tail", record_body, f"{args['name']}-tail")
    return result


@workflow("nap-then-step")
async def nap_then_step(ctx: Context, args: dict[str, Any]) -> str:
    await ctx.step("first", record_body, f"{args['name']}-first")
    await ctx.sleep("nap", args["seconds"])
    return await ctx.step("second", record_body, f"{args['name']}-second")


@workflow("big-result")
async def big_result(ctx: Context, size: int) -> str:
    """Returns a value of ``size`` characters (the workflow's own result, no step)."""
    return "x" * size


def shout(size: int) -> None:
    raise NonRetryableError("!" * size)


@workflow("loud-failure")
async def loud_failure(ctx: Context, size: int) -> str:
    """A step whose error message is ``size`` characters long."""
    try:
        await ctx.step("shout", shout, size)
    except StepFailed as exc:
        return f"caught {len(str(exc))}"
    return "not reached"


# How many times the code of each "counted" instance began to run (in this process).
RUNS: dict[str, int] = {}


@workflow("counted")
async def counted(ctx: Context, n: int) -> int:
    """Counts its own (re)starts: with the live-instance cache, a running instance's code
    starts once, however many steps it takes."""
    RUNS[ctx.instance_id] = RUNS.get(ctx.instance_id, 0) + 1
    value = 0
    for i in range(n):
        value = await ctx.step(f"s{i}", add, value, 1)
    await ctx.sleep("nap", 0.01)
    return value


@workflow("event-steps-event")
async def event_steps_event(ctx: Context, steps: int) -> list[Any]:
    """Two waits for one event name with many steps between: more commands than any
    in-memory window of recent command ids holds."""
    first = await ctx.wait_for_event("item", key="item-1")
    value = 0
    for i in range(steps):
        value = await ctx.step(f"s{i}", add, value, 1)
    second = await ctx.wait_for_event("item", key="item-2")
    return [first, value, second]


@workflow("late-waits")
async def late_waits(ctx: Context, seconds: float) -> list[Any]:
    """Sleeps before it waits twice: events sent meanwhile are buffered."""
    await ctx.sleep("first", seconds)
    one = await ctx.wait_for_event("item", key="item-1")
    two = await ctx.wait_for_event("item", key="item-2")
    return [one, two]


@workflow("attempt-aware")
async def attempt_aware(ctx: Context, succeed_on: int) -> dict[str, Any]:
    """Step bodies (sync in a thread, async on the loop) read ``ctx.attempt``."""

    def sync_body() -> int:
        if ctx.attempt < succeed_on:
            raise RuntimeError(f"attempt {ctx.attempt} fails")
        return ctx.attempt

    async def async_body() -> int:
        await asyncio.sleep(0)
        if ctx.attempt < succeed_on:
            raise RuntimeError(f"attempt {ctx.attempt} fails")
        return ctx.attempt

    policy = RetryPolicy(max_attempts=succeed_on, initial_interval=0.01)
    return {
        "sync": await ctx.step("sync", sync_body, retry=policy),
        "async": await ctx.step("async", async_body, retry=policy),
        "outside": ctx.attempt,
    }


@workflow("counted-waits")
async def counted_waits(ctx: Context, n: int) -> list[Any]:
    """Counts its own (re)starts while it waits for ``n`` events in turn."""
    RUNS[ctx.instance_id] = RUNS.get(ctx.instance_id, 0) + 1
    return [await ctx.wait_for_event("e", key=f"e{i}") for i in range(n)]


@workflow("big-input")
async def big_input(ctx: Context, args: dict[str, Any]) -> dict[str, Any]:
    """Waits for ``n`` events in turn, then answers with its (large) input's size."""
    RUNS[ctx.instance_id] = RUNS.get(ctx.instance_id, 0) + 1
    events = [await ctx.wait_for_event("e", key=f"e{i}") for i in range(args["n"])]
    return {"size": len(args["blob"]), "events": events}


@workflow("drain-after-go")
async def drain_after_go(ctx: Context, n: int) -> list[Any]:
    """Waits for "go"; the ``n`` "item" events sent before it wait in the buffer."""
    await ctx.wait_for_event("go")
    return [await ctx.wait_for_event("item", key=f"item-{i}") for i in range(n)]


async def cancelled_once(key: str) -> str:
    """Raises CancelledError of its own on its first attempt (as when an inner task it
    awaited was cancelled), then succeeds."""
    from stepstream.engine.api.attempts import attempt_number

    if attempt_number() == 1:
        raise asyncio.CancelledError(f"inner task of {key} cancelled")
    return "second attempt"


@workflow("cancelled-step")
async def cancelled_step(ctx: Context, _: Any) -> str:
    # Attempts to spare: a kill -9 test loses the attempt in flight at each of its three
    # kills, and a second attempt is in flight right after the first raised.
    return await ctx.step(
        "fragile",
        cancelled_once,
        ctx.instance_id,
        retry=RetryPolicy(initial_interval=0, max_attempts=6),
    )


@workflow("race-events")
async def race_events(ctx: Context, timeout: float) -> list[Any]:
    """A race of two waits and a deadline; afterwards the workflow waits for the event
    the losing wait was waiting for, which must not have gone to the withdrawn wait."""
    winner, value = await ctx.race(
        {
            "approved": lambda c: c.wait_for_event("approve"),
            "rejected": lambda c: c.wait_for_event("reject"),
            "expired": lambda c: c.sleep("deadline", timeout),
        }
    )
    later = await ctx.wait_for_event("reject" if winner == "approved" else "approve")
    return [winner, value, later]


async def _fetch_part(c: Context, part: str) -> Any:
    return [await c.step("fetch", add, len(part), 0), await c.step("fetch", add, 1, 1)]


@workflow("join-parts")
async def join_parts(ctx: Context, parts: list[str]) -> Any:
    return await ctx.join({p: (lambda c, p=p: _fetch_part(c, p)) for p in parts})


UNWOUND: list[str] = []  # instances whose coroutine ran its finally block


@workflow("unwinds")
async def unwinds(ctx: Context, _: Any) -> Any:
    try:
        return await ctx.wait_for_event("go")
    finally:
        UNWOUND.append(ctx.instance_id)
        try:
            await ctx.step("cleanup", add, 1, 1)  # refused while evicted: never recorded
        except Exception:
            UNWOUND.append("caught")  # Evicted is not an Exception: never reached


@workflow("polling")
async def polling(ctx: Context, args: dict[str, int]) -> Any:
    """Counts to ``n`` one step an iteration, waiting for an event at ``pause_at``."""
    from stepstream import Break, Continue

    async def body(c: Context, count: int) -> Any:
        count = await c.step("tick", add, count, 1)
        if count == args["pause_at"]:
            await c.wait_for_event("go-on")
        return Continue(count) if count < args["n"] else Break(count)

    return await ctx.loop("poll", body, state=0, keep=args.get("keep", 3))


BOOKED: list[str] = []


def book(what: str) -> str:
    BOOKED.append(f"book {what}")
    return f"{what}-1"


def unbook(booking: str) -> None:
    BOOKED.append(f"cancel {booking}")


@workflow("trip")
async def trip(ctx: Context, fail: bool) -> Any:
    from stepstream import RolledBack

    try:
        async with ctx.saga("booking"):
            await ctx.step("flight", book, "flight", compensate=unbook)
            await ctx.step("hotel", book, "hotel", compensate=unbook)
            if fail:
                await ctx.wait_for_event("payment-failed")
                raise RuntimeError("payment failed")
        return "booked"
    except RolledBack as exc:
        return f"rolled back: {exc.cause}"


@workflow("kid")
async def kid(ctx: Context, args: dict[str, Any]) -> Any:
    if args.get("wait"):
        await ctx.wait_for_event("kid-go")
    if args.get("fail"):
        await ctx.step("break", fatal)
    return {"kid": ctx.instance_id, "doubled": await ctx.step("double", async_double, args["n"])}


@workflow("parent")
async def parent(ctx: Context, args: dict[str, Any]) -> Any:
    from stepstream import ChildFailed

    first = await ctx.child("kid", {"n": args["n"]})
    handle = await ctx.start_child("kid", {"n": args["n"] + 1, "wait": args.get("wait", False)})
    try:
        second = await handle.result()
    except ChildFailed as exc:
        second = f"{exc.status}: {exc.error}"
    try:
        await ctx.child("kid", {"n": 0, "fail": True}, instance_id=f"{ctx.instance_id}-bad")
    except ChildFailed as exc:
        return [first, second, exc.status, exc.error_type]
    return [first, second]


@workflow("mailbox")
async def mailbox(ctx: Context, args: dict[str, Any]) -> Any:
    """Takes ``count`` lines (in batches of up to 2), answers each, and tells ``notify``
    (another instance) how many it took."""
    taken: list[Any] = []
    while len(taken) < args["count"]:
        for msg in await ctx.messages.next_batch(["line", "urgent"], max=2):
            taken.append([msg.name, msg.payload])
            await msg.complete({"took": msg.payload})
    if args.get("notify"):
        await ctx.messages.send(args["notify"], "tally", len(taken))
    return taken


@workflow("quoter")
async def quoter(ctx: Context, _: Any) -> int:
    """Answers "quote" requests until it gets "stop"; returns how many it answered."""
    answered = 0
    while True:
        msg = await ctx.messages.next(["quote", "stop"])
        if msg.name == "stop":
            return answered
        await msg.complete({"price": msg.payload["qty"] * 3})
        answered += 1


@workflow("ephemeral")
async def ephemeral_wf(ctx: Context, n: int) -> int:
    total = 0
    for i in range(n):
        total = await ctx.step("tick", add, total, i, ephemeral=True)
    return total


@workflow("orphan-parent")
async def orphan_parent(ctx: Context, _: Any) -> Any:
    from stepstream import ChildFailed

    try:
        return await ctx.child("no-such-workflow", 1)
    except ChildFailed as exc:
        return [exc.status, exc.error_type]


@workflow("adopter")
async def adopter(ctx: Context, taken: str) -> Any:
    """Starts a child under an id that another instance holds already."""
    from stepstream import ChildFailed

    try:
        return await ctx.child("kid", {"n": 1}, instance_id=taken)
    except ChildFailed as exc:
        return [exc.status, exc.error_type, exc.child_id, str(exc)]


@workflow("racing-parent")
async def racing_parent(ctx: Context, _: Any) -> Any:
    """A child that waits for an event races a short sleep, and loses."""

    async def child(c: Context) -> Any:
        return await c.child("kid", {"n": 1, "wait": True})

    async def beat(c: Context) -> str:
        await c.sleep("beat", 0.3)
        return "beat"

    return await ctx.race({"child": child, "beat": beat})


# ---- reset, retry, fork (tests/integration/test_reset.py) ---------------------------------


def charge(instance_id: str, name: str) -> str:
    ledger(f"{instance_id}-{name}")
    return f"charged {name}"


def ship(instance_id: str) -> str:
    """Fails for good until the test opens the gate (a file in the ledger directory)."""
    ledger(f"{instance_id}-ship")
    root = os.environ.get("STEPSTREAM_TEST_LEDGER", "")
    if not (Path(root) / f"open-{instance_id}").exists():
        raise NonRetryableError(f"the warehouse of {instance_id} is closed")
    return "shipped"


@workflow("repairable")
async def repairable(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    first = await ctx.step("charge", charge, ctx.instance_id, "charge")
    second = await ctx.step("charge", charge, ctx.instance_id, "charge#2")
    go = await ctx.wait_for_event("go")
    shipped = await ctx.step("ship", ship, ctx.instance_id)
    return {"charges": [first, second], "go": go, "ship": shipped}


class _Amount(float):
    """As numpy.float64 is: a float subclass."""


class Tier(StrEnum):
    GOLD = "gold"


class Level(IntEnum):
    HIGH = 3


@workflow("tagged-typed")
async def tagged_typed(ctx: Context, amount: float) -> str:
    """Sets attributes of subclasses of the scalar types, as code passes them along."""
    ctx.set_attributes({"amount": _Amount(amount), "tier": Tier.GOLD, "level": Level.HIGH})
    return await ctx.step("after", str, amount)


@workflow("tagged")
async def tagged(ctx: Context, attributes: dict[str, Any]) -> dict[str, Any]:
    """Sets ``attributes``, waits for an event "more" and merges its payload in too."""
    ctx.set_attributes(attributes)
    more: dict[str, Any] = await ctx.wait_for_event("more")
    ctx.set_attributes(more)
    return more


@workflow("nap-then-mail")
async def nap_then_mail(ctx: Context, args: dict[str, Any]) -> dict[str, Any]:
    """A step, a sleep until a set time (shared by many instances, so they wake in one
    batch), then an event that was sent while it slept."""
    tag = await ctx.step("tag", add, args["n"], 1000)
    await ctx.sleep_until("nap", datetime.fromisoformat(args["until"]))
    mail = await ctx.wait_for_event("mail")
    return {"n": args["n"], "tag": tag, "mail": mail, "note": args["note"]}
