"""Replay keys of round 2: repeated names, scopes, try_step, and the calls that are
refused because they could not be replayed. Each case is also replayed after a crash
(a new owner folds the history and drives the code again) and must reach the same
state without running a body twice."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from stepstream.engine.api.context import Context
from stepstream.engine.api.retry import RetryPolicy
from stepstream.engine.errors import NonRetryableError
from stepstream.engine.replay.state import Status
from tests.unit.test_runtime import Harness, define, ident

FAST = RetryPolicy(max_attempts=2, initial_interval=0)


async def _loop_of_steps_and_waits(ctx: Context, items: list[int]) -> list[Any]:
    out = []
    for item in items:
        out.append(await ctx.step("charge", ident, item))
        out.append(await ctx.wait_for_event("item"))
    return out


def test_a_loop_reuses_names_and_waits_take_the_next_event() -> None:
    h = Harness(define("loop", _loop_of_steps_and_waits))
    h.start([1, 2, 3])
    h.run_all()
    h.send("item", "a")
    h.run_all()
    h.crash()  # replays charge, item, charge#2 ... from history
    h.run_all()
    h.send("item", "b")
    h.run_all()
    h.send("item", "c")
    h.run_all()
    assert h.result() == [1, "a", 2, "b", 3, "c"]
    assert h.ran == {"charge": 1, "charge#2": 1, "charge#3": 1}
    assert sorted(k for k in h.state.entries) == sorted(
        ["charge", "charge#2", "charge#3", "item", "item#2", "item#3"]
    )
    h.check_history()


async def _scoped(ctx: Context, _: Any) -> list[Any]:
    got = [await ctx.step("pay", ident, "top")]
    async with ctx.scope("shipping"):
        got.append(await ctx.step("pay", ident, "ship-1"))
        got.append(await ctx.step("pay", ident, "ship-2"))
    async with ctx.scope("shipping"):
        got.append(await ctx.step("pay", ident, "again"))
    got.append(await ctx.step("pay", ident, "top-2"))
    return got


def test_scopes_prefix_names_and_repeat_like_names() -> None:
    h = Harness(define("scoped", _scoped))
    h.start(None)
    h.run_all()
    assert h.result() == ["top", "ship-1", "ship-2", "again", "top-2"]
    assert sorted(h.state.entries) == [
        "pay",
        "pay#2",
        "shipping#2/pay",
        "shipping/pay",
        "shipping/pay#2",
    ]
    h.crash()
    assert h.result() == ["top", "ship-1", "ship-2", "again", "top-2"]


async def _gathered(ctx: Context, n: int) -> list[Any]:
    return list(await asyncio.gather(*(ctx.step("charge", ident, i) for i in range(n))))


def test_gathered_steps_of_one_name_get_keys_in_call_order() -> None:
    """Keys are taken when ctx.step is called, so the order branches run in (which
    differs between a live run and a replay) does not matter."""
    h = Harness(define("gathered", _gathered))
    h.start(3)
    # Finish them in reverse order.
    for key in ("charge#3", "charge#2", "charge"):
        h.run(key)
    assert h.result() == [0, 1, 2]
    h.crash()
    assert h.result() == [0, 1, 2]
    assert h.ran == {"charge": 1, "charge#2": 1, "charge#3": 1}


async def _branch(ctx: Context, value: int) -> Any:
    first = await ctx.step("charge", ident, value)
    return first, await ctx.step("charge", ident, value * 10)


async def _concurrent_same_scope(ctx: Context, _: Any) -> Any:
    return await asyncio.gather(_branch(ctx, 1), _branch(ctx, 2))


async def _concurrent_own_scopes(ctx: Context, _: Any) -> Any:
    async def scoped(name: str, value: int) -> Any:
        async with ctx.scope(name):
            return await _branch(ctx, value)

    return await asyncio.gather(scoped("a", 1), scoped("b", 2))


def test_one_name_in_two_concurrent_branches_of_one_scope_is_refused() -> None:
    h = Harness(define("clash", _concurrent_same_scope))
    h.start(None)
    h.run_all()
    assert h.state.status is Status.FAILED
    assert h.state.error_type == "InvalidWorkflowCall"
    assert "concurrent branches" in h.state.error_message
    ok = Harness(define("scoped-branches", _concurrent_own_scopes))
    ok.start(None)
    ok.run_all()
    assert ok.result() == [[1, 10], [2, 20]]
    assert sorted(ok.state.entries) == ["a/charge", "a/charge#2", "b/charge", "b/charge#2"]
    ok.crash()
    assert ok.result() == [[1, 10], [2, 20]]


async def _late_sibling(ctx: Context, _: Any) -> Any:
    """A uses "charge" after a step of its own, B at once: B's use is over before A's
    comes, but the two were alive together, and replay could let A come first."""

    async def a() -> Any:
        await ctx.step("first", ident, 0)
        return await ctx.step("charge", ident, "a")

    async def b() -> Any:
        return await ctx.step("charge", ident, "b")

    return await asyncio.gather(a(), b())


async def _one_after_another(ctx: Context, _: Any) -> Any:
    """Each gather's task is made after the last one's use: the order is the code's."""
    first = await asyncio.gather(ctx.step("charge", ident, 1))
    second = await asyncio.gather(ctx.step("charge", ident, 2))
    return [*first, *second]


def test_a_name_used_by_siblings_that_were_alive_together_is_refused() -> None:
    h = Harness(define("late-sibling", _late_sibling))
    h.start(None)
    h.run("charge")  # B's step ends, and B with it
    h.run("first")  # then A goes on to "charge"
    assert h.state.status is Status.FAILED
    assert "concurrent branches" in h.state.error_message
    ok = Harness(define("one-after-another", _one_after_another))
    ok.start(None)
    ok.run_all()
    assert ok.result() == [1, 2]
    ok.crash()
    assert ok.result() == [1, 2]
    assert sorted(ok.state.entries) == ["charge", "charge#2"]


@pytest.mark.parametrize("bad", ["a#1", "a/b", "", "x\x00", "tab\there"])
def test_reserved_and_control_characters_in_names_are_refused(bad: str) -> None:
    async def flow(ctx: Context, _: Any) -> Any:
        return await ctx.step(bad, ident, 1)

    h = Harness(define("bad-name", flow))
    h.start(None)
    assert h.state.status is Status.FAILED
    assert h.state.error_type == "InvalidWorkflowCall", h.state.error_message


def _boom(kind: str) -> Any:
    if kind == "fatal":
        raise NonRetryableError("declined")
    raise RuntimeError("flaky")


async def _tries(ctx: Context, _: Any) -> list[Any]:
    good = await ctx.try_step("good", ident, 5)
    fatal = await ctx.try_step("fatal", _boom, "fatal", retry=FAST)
    flaky = await ctx.try_step("flaky", _boom, "flaky", retry=FAST)
    out: list[Any] = [good.ok, good.value]
    for r in (fatal, flaky):
        assert r.failure is not None
        out.append([r.ok, r.failure.kind, r.failure.attempts, r.failure.error_type])
    return out


def test_try_step_returns_a_result_instead_of_raising() -> None:
    h = Harness(define("tries", _tries))
    h.start(None)
    h.run("good")
    h.fail("fatal", "declined", retryable=False)
    h.run_all()
    expected = [True, 5, [False, "non_retryable", 1, "RuntimeError"]]
    expected.append([False, "exhausted", 2, "RuntimeError"])
    assert h.result() == expected
    h.crash()
    assert h.result() == expected


def test_a_non_retryable_error_at_the_last_attempt_is_still_non_retryable() -> None:
    # The first attempt of "fatal" failed (or was lost to a crash); the second, its last,
    # raised NonRetryableError: that is why the step ended, not the attempts running out.
    h = Harness(define("tries", _tries))
    h.start(None)
    h.run("good")
    h.fail("fatal", "flaked")
    h.fire()  # the retry's backoff
    h.fail("fatal", "declined", retryable=False, error_type="NonRetryableError")
    h.run_all()
    fatal = [False, "non_retryable", 2, "NonRetryableError"]
    assert h.result() == [True, 5, fatal, [False, "exhausted", 2, "RuntimeError"]]
    h.crash()
    assert h.result()[2] == fatal


async def _tries_for_ever(ctx: Context, _: Any) -> list[Any]:
    r = await ctx.try_step("charge", _boom, "fatal", retry=RetryPolicy(max_attempts=None))
    assert r.failure is not None
    return [r.failure.kind, r.failure.attempts, r.failure.error_type]


def test_a_step_that_retries_for_ever_and_gives_up_was_not_exhausted() -> None:
    # A subclass of NonRetryableError is recorded by its own name; a policy without a
    # limit cannot run out, so the step ended because the error said not to retry.
    h = Harness(define("for-ever", _tries_for_ever))
    h.start(None)
    h.fail("charge", "declined", retryable=False, error_type="CardDeclined")
    h.run_all()
    assert h.result() == ["non_retryable", 1, "CardDeclined"]
    h.crash()
    assert h.result() == ["non_retryable", 1, "CardDeclined"]


async def _forever(ctx: Context, _: Any) -> Any:
    return await ctx.step("until-ok", ident, "done", retry=RetryPolicy(max_attempts=None))


def test_a_retry_policy_without_a_limit_retries_past_any_count() -> None:
    h = Harness(define("forever", _forever))
    h.start(None)
    for _ in range(25):
        h.fail("until-ok")
        h.fire()
    h.run_all()
    assert h.result() == "done"
    assert h.state.entries["until-ok"].attempt == 26


def _nested(ctx: Context) -> Any:
    return ctx.step("inner", ident, 1)


async def _step_in_body(ctx: Context, _: Any) -> Any:
    return await ctx.step("outer", _nested, ctx)


def test_ctx_step_inside_a_step_body_is_refused_at_once() -> None:
    from stepstream.engine.api.attempts import AttemptFlag, current_flag

    h = Harness(define("nested", _step_in_body))
    h.start(None)
    launch = h.launch("outer")
    token = current_flag.set(AttemptFlag(launch.attempt))  # as the step executor sets it
    try:
        with pytest.raises(Exception, match="inside a step body") as caught:
            launch.fn(*launch.args)
    finally:
        current_flag.reset(token)
    assert type(caught.value).__name__ == "InvalidWorkflowCall"
    assert "inner" not in h.state.entries


# ---- join and race ----------------------------------------------------------------------


async def _joined(ctx: Context, fail: bool) -> Any:
    async def a(c: Context) -> Any:
        return [await c.step("charge", ident, "a1"), await c.step("charge", ident, "a2")]

    async def b(c: Context) -> Any:
        got = await c.wait_for_event("go")
        if fail:
            raise RuntimeError("b broke")
        return got

    from stepstream.engine.errors import JoinError

    try:
        return await ctx.join({"a": a, "b": b})
    except JoinError as exc:
        return {"errors": {k: str(v) for k, v in exc.errors.items()}, "results": exc.results}


def test_join_runs_named_branches_in_their_own_scopes() -> None:
    h = Harness(define("joined", _joined))
    h.start(False)
    h.run_all()
    h.crash()
    h.send("go", "now")
    h.run_all()
    assert h.result() == {"a": ["a1", "a2"], "b": "now"}
    assert sorted(h.state.entries) == ["join/a/charge", "join/a/charge#2", "join/b/go"]


def test_join_lets_every_branch_settle_then_reports_the_failures() -> None:
    h = Harness(define("joined", _joined))
    h.start(True)
    h.send("go", "now")
    h.run_all()
    assert h.result() == {"errors": {"b": "b broke"}, "results": {"a": ["a1", "a2"]}}


async def _raced(ctx: Context, _: Any) -> Any:
    winner, value = await ctx.race(
        {
            "paid": lambda c: c.wait_for_event("paid"),
            "late": lambda c: c.sleep("deadline", 3600),
            "busy": lambda c: c.step("work", ident, "w"),
        }
    )
    after = await ctx.wait_for_event("paid")  # a later event is not taken by the loser
    return [winner, value, after]


def test_race_records_the_winner_and_abandons_the_losers() -> None:
    from stepstream.engine.wire.records import RaceDecided

    h = Harness(define("raced", _raced))
    h.start(None)
    assert h.launch("race/busy/work")  # an attempt is running in a loser-to-be
    h.send("paid", "p1")  # the wait wins
    [decided] = h.of_type(RaceDecided)
    assert (decided.winner, decided.losers) == ("paid", ["race/late/", "race/busy/"])
    assert h.timers == {}  # the deadline's timer was cancelled
    entries = h.state.entries
    assert entries["race/late/deadline"].state.value == "abandoned"
    assert entries["race/busy/work"].state.value == "abandoned"
    h.run("race/busy/work")  # the late outcome of the loser is ignored
    assert "StepSucceeded" not in [r.type for r in h.records]
    h.crash()  # replay runs only the winner
    h.send("paid", "p2")
    h.run_all()
    assert h.result() == ["paid", "p1", "p2"]
    h.check_history()


def test_a_race_whose_branches_all_fail_raises_race_error() -> None:
    async def flow(ctx: Context, _: Any) -> Any:
        from stepstream.engine.errors import RaceError

        async def broken(c: Context) -> Any:
            await c.step("s", ident, 1)
            raise RuntimeError("no")

        try:
            return await ctx.race({"x": broken, "y": broken})
        except RaceError as exc:
            return sorted(exc.errors)

    h = Harness(define("all-fail", flow))
    h.start(None)
    h.run_all()
    assert h.result() == ["x", "y"]


# ---- sagas --------------------------------------------------------------------------------

UNDONE: list[Any] = []


def _book(what: str) -> str:
    return f"{what}-booking"


def _undo(booking: str) -> str:
    UNDONE.append(booking)
    return f"cancelled {booking}"


def _card_declined() -> None:
    raise NonRetryableError("card declined")


async def _trip(ctx: Context, fail: bool) -> Any:
    from stepstream.engine.errors import RolledBack

    try:
        async with ctx.saga("booking"):
            await ctx.step("flight", _book, "flight", compensate=_undo)
            await ctx.step("hotel", _book, "hotel", compensate=_undo)
            await ctx.step("car", _book, "car")  # nothing to undo
            if fail:
                await ctx.step("pay", _card_declined)
        return "booked"
    except RolledBack as exc:
        return {"rolled_back": str(exc.cause), "compensation_errors": list(exc.compensation_errors)}


def test_a_saga_compensates_completed_steps_newest_first_exactly_once() -> None:
    UNDONE.clear()
    h = Harness(define("trip", _trip))
    h.start(True)
    h.run("booking/flight")
    h.run("booking/hotel")
    h.run("booking/car")
    h.fail("booking/pay", "card declined", retryable=False)
    # The first compensation (hotel, the newest) runs; then a crash.
    h.run("booking/hotel/undo")
    h.crash()  # replay: flight's compensation is started, hotel's is not run again
    h.run_all()
    assert h.result() == {
        "rolled_back": "step 'booking/pay' of instance inst-1 failed after 1 attempt(s): "
        "RuntimeError: card declined",
        "compensation_errors": [],
    }
    assert UNDONE == ["hotel-booking", "flight-booking"]
    assert h.ran["booking/hotel/undo"] == 1 and h.ran["booking/flight/undo"] == 1


def test_a_saga_that_completes_compensates_nothing() -> None:
    UNDONE.clear()
    h = Harness(define("trip", _trip))
    h.start(False)
    h.run_all()
    assert h.result() == "booked" and UNDONE == []


def test_compensate_outside_a_saga_is_refused() -> None:
    async def flow(ctx: Context, _: Any) -> Any:
        return await ctx.step("x", ident, 1, compensate=_undo)

    h = Harness(define("no-saga", flow))
    h.start(None)
    assert h.state.error_type == "InvalidWorkflowCall"
    assert "ctx.saga" in h.state.error_message


# ---- loops --------------------------------------------------------------------------------

BODY_RUNS: list[int] = []


async def _poll(ctx: Context, limit: int) -> Any:
    from stepstream.engine.api.loops import Break, Continue

    async def body(c: Context, total: int) -> Any:
        BODY_RUNS.append(total)
        got = await c.step("fetch", ident, 1)
        if total + got >= limit:
            return Break({"total": total + got, "at": c.now().year > 2000})
        if total == 2:
            await c.wait_for_event("more")
        return Continue(total + got)

    return await ctx.loop("poll", body, state=0, keep=2)


def test_a_loop_carries_state_and_replay_starts_at_the_last_iteration() -> None:
    BODY_RUNS.clear()
    h = Harness(define("poll", _poll))
    h.start(6)
    h.run_all()  # iterations 0, 1, 2 (waits in 2)
    assert BODY_RUNS == [0, 1, 2]
    BODY_RUNS.clear()
    h.crash()  # replay: only the iteration in progress (2) runs again, from its state
    assert BODY_RUNS == [2]
    h.send("more", None)
    h.run_all()
    assert h.result() == {"total": 6, "at": True}
    assert h.ran["poll/3/fetch"] == 1
    # The last `keep` iterations that went on (3, 4) keep their entries, and the last
    # one (5, which broke out); the loop's own entry stays.
    assert sorted(h.state.entries) == [
        "poll",
        "poll/3/fetch",
        "poll/4/fetch",
        "poll/5/fetch",
        "poll/5/now#1",
    ]
    h.crash()
    assert h.result() == {"total": 6, "at": True}


async def _endless(ctx: Context, n: int) -> Any:
    from stepstream.engine.api.loops import Break, Continue

    async def body(c: Context, i: int) -> Any:
        await c.step("tick", ident, i)
        return Continue(i + 1) if i + 1 < n else Break(i + 1)

    return await ctx.loop("ticks", body, state=0, keep=3)


def test_a_long_loop_holds_bounded_state_and_prunes_stored_history() -> None:
    h = Harness(define("endless", _endless))
    h.start(2_000)
    most = 0
    while h.launches:
        h.run(h.launches[0].key)
        rt = h.runtime
        kept = len(rt._futures) + len(rt._intents) + len(rt._visited) + len(rt._names)
        most = max(most, kept)
    # What the coroutine keeps of finished iterations goes in batches, not for ever.
    assert most < 1_000, most
    assert h.result() == 2_000
    assert len(h.state.entries) <= 1 + 4  # the loop, and the last iterations' steps
    pruned = sum(high - low for low, high in h.state.pruned_history)
    kept = len(h.records) - pruned
    assert kept < 30, (kept, len(h.records))  # the stored history is bounded too
    h.crash()
    assert h.result() == 2_000


# ---- messages -----------------------------------------------------------------------------


async def _queue(ctx: Context, _: Any) -> Any:
    got = []
    await ctx.wait_for_event("begin")
    first = await ctx.messages.next(["line", "stop"])
    got.append([first.name, first.payload])
    batch = await ctx.messages.next_batch("line", max=2)
    got.append([[m.name, m.payload] for m in batch])
    none = await ctx.messages.next_batch("line", max=5, timeout=10)
    got.append(none)
    await first.complete({"answered": first.id})
    return got


def test_messages_are_taken_in_arrival_order_and_batches_take_what_is_there() -> None:
    h = Harness(define("queue", _queue))
    h.start(None)
    for n in (1, 2, 3):
        h.send("line", n, command_id=f"m{n}")  # buffered until the workflow takes them
    h.send("other", 0, command_id="o1")
    h.send("begin", None)
    h.crash()  # replay takes the same messages
    h.run_all()  # the last batch times out: []
    assert h.result() == [["line", 1], [["line", 2], ["line", 3]], []]
    assert [b.command_id for b in h.state.buffered] == ["o1"]
    assert "~reply/m1" in h.state.entries


async def _two_waits(ctx: Context, _: Any) -> Any:
    return [await ctx.wait_for_event("go"), (await ctx.messages.next("go")).payload]


def test_events_sent_while_paused_wait_until_resume() -> None:
    from stepstream.engine.wire.records import PauseWorkflow, ResumeWorkflow

    h = Harness(define("two-waits", _two_waits))
    h.start(None)
    h.feed(PauseWorkflow(instance_id=h.instance_id, command_id="p"))
    h.send("go", "a")
    h.send("go", "b")
    assert "WaitSatisfied" not in [r.type for r in h.records]  # held while paused
    h.feed(ResumeWorkflow(instance_id=h.instance_id, command_id="r"))
    assert h.result() == ["a", "b"]


# ---- ephemeral steps ----------------------------------------------------------------------


async def _ticks(ctx: Context, n: int) -> Any:
    got = [await ctx.step("tick", ident, i, ephemeral=True) for i in range(n)]
    return [*got, await ctx.step("flaky", ident, "ok", ephemeral=True, retry=FAST)]


def test_an_ephemeral_step_records_only_its_result() -> None:
    h = Harness(define("ticks", _ticks))
    h.start(2)
    assert "StepAttemptStarted" not in [r.type for r in h.records]
    assert [x.key for x in h.launches] == ["tick"]
    h.crash()  # nothing was recorded: it runs again after a crash
    assert [x.key for x in h.launches] == ["tick"]
    h.run("tick")
    h.run("tick#2")
    h.fail("flaky")  # a failure is recorded, and retried durably
    h.run_all()
    assert h.result() == [0, 1, "ok"]
    types = [(r.type, getattr(r, "key", "")) for r in h.records]
    assert ("StepAttemptStarted", "tick") not in types
    assert ("StepSucceeded", "tick") in types and ("StepSucceeded", "tick#2") in types
    assert [t for t in types if t[1] == "flaky"] == [
        ("StepAttemptStarted", "flaky"),
        ("StepFailed", "flaky"),
        ("StepAttemptStarted", "flaky"),
        ("StepSucceeded", "flaky"),
    ]
    h.crash()
    assert h.result() == [0, 1, "ok"]
