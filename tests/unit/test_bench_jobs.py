"""``gather_limited``, which runs every bench workload's calls a few at a time: a bench
stopped with Ctrl-C or SIGTERM takes no more calls, even when a call's code lets the
cancel go by (Python 3.11's ``asyncio.wait_for`` loses one that lands as the awaited
call completes), so it stops instead of going on through all the rest."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from stepstream.ops.bench.workloads import gather_limited


async def test_a_stopped_run_takes_no_more_jobs_even_if_one_swallows_the_cancel() -> None:
    ran: list[int] = []

    def job(i: int) -> Callable[[], Awaitable[None]]:
        async def one() -> None:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                pass  # let go by, as wait_for may
            ran.append(i)

        return one

    task = asyncio.ensure_future(gather_limited([job(i) for i in range(100)], 2))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ran == [0, 1]


async def test_results_come_back_in_order() -> None:
    def job(i: int) -> Callable[[], Awaitable[int]]:
        async def one() -> int:
            await asyncio.sleep(0.001 * (5 - i % 5))
            return i

        return one

    assert await gather_limited([job(i) for i in range(20)], 3) == list(range(20))


def test_a_scrape_group_with_no_scrape_in_it_is_null_not_zero() -> None:
    """``--scrape-interval`` longer than the firing: the firing group has no scrape, and
    its figures say "none" (null) rather than an instant scrape (0)."""
    from stepstream.ops.bench.scrape import _Scrape, _summary

    empty = _summary("firing_", [])
    assert empty["firing_scrapes"] == 0
    assert {k: v for k, v in empty.items() if k != "firing_scrapes"} == dict.fromkeys(
        [f"firing_{n}_ms" for n in ("duration_p50", "duration_p99", "duration_max")]
        + [f"firing_{n}_ms" for n in ("hold_p50", "hold_p99", "hold_max")]
    )
    one = _summary("idle_", [_Scrape(at=0.0, duration_ms=12.0, hold_ms=2.0, nbytes=100)])
    assert one["idle_duration_p50_ms"] == one["idle_duration_max_ms"] == 12.0
