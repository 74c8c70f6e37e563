"""``engine.virtual_clock.VirtualClock``: sleepers wake when the clock is moved, in order."""

from __future__ import annotations

import asyncio

import pytest

from stepstream.engine.virtual_clock import VirtualClock


async def test_sleepers_wake_in_order_when_the_clock_reaches_them() -> None:
    clock = VirtualClock(1_000)
    woke: list[tuple[str, int]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now_ms()))

    tasks = [asyncio.ensure_future(sleeper(n, s)) for n, s in (("b", 2), ("a", 1), ("c", 3))]
    await asyncio.sleep(0)
    assert clock.next_wake_ms() == 2_000
    clock.advance(1.5)
    await asyncio.sleep(0)
    assert woke == [("a", 2_500)]
    clock.set_ms(4_000)
    await asyncio.gather(*tasks)
    assert [name for name, _ in woke] == ["a", "b", "c"]
    assert clock.next_wake_ms() is None


async def test_no_wall_time_passes_and_a_zero_sleep_returns_at_once() -> None:
    clock = VirtualClock(0)
    await asyncio.wait_for(clock.sleep(0), 0.1)
    await asyncio.wait_for(clock.sleep(-5), 0.1)
    sleeping = asyncio.ensure_future(clock.sleep(30 * 86400))
    await asyncio.sleep(0.01)
    assert not sleeping.done()
    clock.advance(30 * 86400)
    await asyncio.wait_for(sleeping, 0.1)


async def test_a_cancelled_sleep_is_dropped() -> None:
    clock = VirtualClock(0)
    sleeping = asyncio.ensure_future(clock.sleep(1))
    await asyncio.sleep(0)
    sleeping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeping
    assert clock.next_wake_ms() is None
    clock.advance(2)  # nothing to wake, nothing raises


def test_the_clock_never_goes_back() -> None:
    clock = VirtualClock(5_000)
    with pytest.raises(ValueError, match="does not go back"):
        clock.set_ms(4_999)
    clock.advance(0)
    assert clock.now_ms() == 5_000


def test_it_starts_at_the_wall_time_unless_told() -> None:
    import time

    assert abs(VirtualClock().now_ms() - time.time() * 1000) < 5_000
