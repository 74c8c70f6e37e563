"""Sagas as a user writes them (``ctx.saga`` and ``compensate=``), through
``stepstream.testing``: what a rollback undoes, in which order, and that a replay in the
middle of one undoes the same things in the same order."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from stepstream import Context, NonRetryableError, RolledBack, workflow
from stepstream.testing import WorkflowEnvironment

_WAIT = 30.0  # seconds a step body waits for its cue before it gives up


class _Trip:
    """The bodies of one test's steps: bookings, their undos, and the cues between them."""

    def __init__(self) -> None:
        self.undone: list[str] = []
        self.hotel_booked = threading.Event()
        self.release_undo = threading.Event()
        self.undo_calls = 0
        self.lock = threading.Lock()

    def book(self, what: str) -> str:
        return what

    def book_flight_after_hotel(self) -> str:
        assert self.hotel_booked.wait(_WAIT)
        return "flight"

    def book_hotel(self) -> str:
        self.hotel_booked.set()
        return "hotel"

    def undo(self, what: str) -> str:
        with self.lock:
            self.undo_calls += 1
            first = self.undo_calls == 1
        if first:  # the first compensation hangs until the test lets it go
            assert self.release_undo.wait(_WAIT)
        self.undone.append(what)
        return f"undone {what}"

    def decline(self) -> None:
        raise NonRetryableError("card declined")


async def _rolled_back(name: str, body: Callable[[Context], Awaitable[Any]]) -> str:
    """Run ``body`` in a saga "trip" as workflow ``name``; what its ``RolledBack`` said,
    with the type of its cause."""

    @workflow(name)
    async def flow(ctx: Context, _: Any) -> Any:
        try:
            async with ctx.saga("trip"):
                await body(ctx)
        except RolledBack as exc:
            return f"{exc} [cause: {type(exc.cause).__name__}]"
        return "booked"

    async with WorkflowEnvironment([flow], clock="virtual") as env:
        await env.client.start(name, None, instance_id=f"{name}-1")
        return str(await env.client.result(f"{name}-1", timeout=_WAIT))


def _undo_keys(history: list[Any]) -> list[str]:
    return [
        e.attributes["key"]
        for e in history
        if e.type == "StepSucceeded" and e.attributes.get("key", "").endswith("/undo")
    ]


async def test_a_crash_during_a_rollback_of_parallel_steps_undoes_each_once_in_order() -> None:
    """Two compensable steps side by side, the second finishing first; the engine is
    killed while the first compensation runs. The replay undoes in the order the run
    did (newest start first), so the instance completes instead of diverging."""
    trip = _Trip()

    @workflow("parallel-trip")
    async def parallel_trip(ctx: Context, _: Any) -> Any:
        try:
            async with ctx.saga("trip"):

                async def flight(ctx: Context) -> Any:
                    return await ctx.step(
                        "book", trip.book_flight_after_hotel, compensate=trip.undo
                    )

                async def hotel(ctx: Context) -> Any:
                    return await ctx.step("book", trip.book_hotel, compensate=trip.undo)

                await ctx.join({"flight": flight, "hotel": hotel})
                await ctx.step("pay", trip.decline)
        except RolledBack as exc:
            return {"rolled_back": str(exc)}
        return "booked"

    async with WorkflowEnvironment([parallel_trip], clock="virtual") as env:
        await env.client.start("parallel-trip", None, instance_id="t-1")
        for _ in range(int(_WAIT / 0.01)):
            history = await env.client.history("t-1")
            if any(e.attributes.get("key", "").endswith("/undo") for e in history):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("no compensation started")
        await env.crash()
        trip.release_undo.set()  # the abandoned attempt's thread ends; its result is lost
        await env.advance(120)  # the compensation's retry backoff
        result = await env.client.result("t-1", timeout=_WAIT)
        status = await env.client.status("t-1")
        history = await env.client.history("t-1")
    assert status.status == "completed", status.error
    assert "rolled back (trip/join/hotel/book, trip/join/flight/book)" in result["rolled_back"]
    assert _undo_keys(history) == ["trip/join/hotel/book/undo", "trip/join/flight/book/undo"]


async def test_a_rollback_waits_for_a_compensable_step_still_running() -> None:
    """``asyncio.gather`` raises at the first failure while the other step still runs:
    that step's booking is undone once it succeeds, not left behind."""
    trip = _Trip()
    trip.release_undo.set()
    flight_may_finish = threading.Event()

    def slow_flight() -> str:
        assert flight_may_finish.wait(_WAIT)
        return "flight"

    def no_rooms() -> None:
        flight_may_finish.set()  # the flight books only after the hotel has failed
        raise NonRetryableError("no rooms")

    async def body(ctx: Context) -> None:
        await asyncio.gather(
            ctx.step("flight", slow_flight, compensate=trip.undo),
            ctx.step("hotel", no_rooms, compensate=trip.undo),
        )

    said = await _rolled_back("gather-trip", body)
    assert "rolled back (trip/flight) after StepFailed" in said
    assert trip.undone == ["flight"]


async def test_an_inner_saga_that_ended_well_is_undone_with_the_outer_one() -> None:
    trip = _Trip()
    trip.release_undo.set()

    async def body(ctx: Context) -> None:
        await ctx.step("flight", trip.book, "flight", compensate=trip.undo)
        async with ctx.saga("stay"):
            await ctx.step("hotel", trip.book, "hotel", compensate=trip.undo)
        await ctx.step("pay", trip.decline)

    said = await _rolled_back("nested-trip", body)
    assert "rolled back (trip/stay/hotel, trip/flight)" in said
    assert trip.undone == ["hotel", "flight"]


async def test_a_compensation_that_is_not_callable_is_refused_where_it_is_given() -> None:
    """A typo'd ``compensate=`` fails at the step that has it, naming it, and what was
    booked before it is still undone."""
    trip = _Trip()
    trip.release_undo.set()

    async def body(ctx: Context) -> None:
        await ctx.step("flight", trip.book, "flight", compensate=trip.undo)
        await ctx.step("hotel", trip.book, "hotel", compensate="cancel_hotel")

    said = await _rolled_back("typo-trip", body)
    assert said.endswith("[cause: InvalidWorkflowCall]")
    assert "compensate='cancel_hotel' is not callable" in said
    assert trip.undone == ["flight"]
