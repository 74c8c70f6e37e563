"""A clock that moves only when told to, for tests (``stepstream.testing``).

``sleep`` waits for the clock to be moved on, not for wall time: the timer service
sleeps on its clock until the next timer is due, so moving a virtual clock fires timers
days ahead at once, and in order.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time


class VirtualClock:
    def __init__(self, start_ms: int | None = None) -> None:
        self._ms = time.time_ns() // 1_000_000 if start_ms is None else start_ms
        self._sleepers: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def now_ms(self) -> int:
        return self._ms

    async def sleep(self, seconds: float) -> None:
        """Return once the clock has been moved ``seconds`` on (at once for 0 or less)."""
        wake = self._ms + round(seconds * 1000)
        if wake <= self._ms:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (wake, next(self._order), fut))
        # A sleep cancelled meanwhile leaves its future cancelled; set_ms drops it.
        await fut

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on and wake the sleepers that are due."""
        self.set_ms(self._ms + round(seconds * 1000))

    def set_ms(self, ms: int) -> None:
        """Move the clock to ``ms`` (never back) and wake the sleepers that are due."""
        if ms < self._ms:
            raise ValueError(f"a clock does not go back: it is at {self._ms}, not {ms}")
        self._ms = ms
        while self._sleepers and self._sleepers[0][0] <= ms:
            fut = heapq.heappop(self._sleepers)[2]
            if not fut.done():
                fut.set_result(None)

    def next_wake_ms(self) -> int | None:
        """When the earliest sleeper wakes, or None if nothing sleeps."""
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)
        return self._sleepers[0][0] if self._sleepers else None
