"""``stepstream bench --scrape-interval S``: the engine's ``/metrics`` scraped every S
seconds while the timers workload runs, as Prometheus would, and what each scrape cost.

A scrape is served on the engine's event loop, so while it is held there no timer fires:
the figures say how long each scrape took as the scraper saw it (``duration``, the round
trip), and how long it held the engine's loop (``hold``, from the ``Server-Timing``
header the engine puts on ``/metrics``; an engine without it reports none). In process
(``--client inprocess``) there is no server: the same rendering is called on the bench's
own loop, and the hold is timed around it.

Two phases are also reported apart: ``idle_*``, scrapes taken while every timer was
pending and none due yet (nothing else on the engine's loop: the round trip is the
scrape alone), and ``firing_*``, those taken while timers came due (the ones that
compete with them).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from stepstream.ops.bench.workloads import pct

# A scrape that takes longer is cut short: Prometheus' default scrape timeout.
TIMEOUT_S = 10.0
_LOOP_TIMING = re.compile(r"(?:^|,)\s*loop;dur=([0-9.]+)")


@dataclass
class _Scrape:
    at: float  # when it began (time.time())
    duration_ms: float
    hold_ms: float | None
    nbytes: int


@dataclass
class Scraper:
    """Scrapes every ``interval_s`` until stopped. The workload marks its phases:
    ``idle_from`` (every timer pending, none due: the engine has nothing else to do, so a
    scrape's round trip there is what it costs alone) and ``firing_from``."""

    interval_s: float
    scrape_once: Callable[[], Awaitable[tuple[float | None, int]]]
    scrapes: list[_Scrape] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    idle_from: float | None = None
    firing_from: float | None = None

    async def run(self) -> None:
        next_at = time.perf_counter()
        while True:
            began_wall, began = time.time(), time.perf_counter()
            try:
                # Not wait_for: Python 3.11's drops a cancellation that lands as the scrape
                # ends, and the scraper would never stop.
                async with asyncio.timeout(TIMEOUT_S):
                    hold_ms, nbytes = await self.scrape_once()
            except (OSError, TimeoutError, ValueError) as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}"[:200])
            else:
                took = (time.perf_counter() - began) * 1000
                self.scrapes.append(_Scrape(began_wall, took, hold_ms, nbytes))
            next_at += self.interval_s
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    def figures(self) -> dict[str, Any]:
        firing_from = self.firing_from or float("inf")
        idle_from = self.idle_from or firing_from
        idle = [s for s in self.scrapes if idle_from <= s.at < firing_from]
        firing = [s for s in self.scrapes if s.at >= firing_from]
        out: dict[str, Any] = {"interval_s": self.interval_s}
        out.update(_summary("", self.scrapes))
        out.update(_summary("idle_", idle))
        out.update(_summary("firing_", firing))
        out["bytes"] = self.scrapes[-1].nbytes if self.scrapes else 0
        out["failures"] = len(self.failures)
        if self.failures:
            out["first_failure"] = self.failures[0]
        return out


def _summary(prefix: str, scrapes: list[_Scrape]) -> dict[str, Any]:
    durations = [s.duration_ms for s in scrapes]
    holds = [s.hold_ms for s in scrapes if s.hold_ms is not None]
    return {
        f"{prefix}scrapes": len(scrapes),
        # None when no scrape fell in the group (0 would read as an instant scrape).
        f"{prefix}duration_p50_ms": pct(durations, 50) if durations else None,
        f"{prefix}duration_p99_ms": pct(durations, 99) if durations else None,
        f"{prefix}duration_max_ms": round(max(durations), 2) if durations else None,
        # None: the engine does not say (it has no Server-Timing on /metrics).
        f"{prefix}hold_p50_ms": pct(holds, 50) if holds else None,
        f"{prefix}hold_p99_ms": pct(holds, 99) if holds else None,
        f"{prefix}hold_max_ms": round(max(holds), 2) if holds else None,
    }


def loop_hold_ms(server_timing: str | None) -> float | None:
    """The ``loop`` entry of a ``Server-Timing`` header, in ms (None if absent)."""
    found = _LOOP_TIMING.search(server_timing or "")
    return float(found.group(1)) if found else None


class _OverHttp:
    """GET ``/metrics`` of every server in turn, on one connection pool."""

    def __init__(self, servers: list[str]) -> None:
        self._servers = servers
        self._http: aiohttp.ClientSession | None = None

    async def __call__(self) -> tuple[float | None, int]:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        hold: float | None = None
        nbytes = 0
        for url in self._servers:
            async with self._http.get(url.rstrip("/") + "/metrics") as response:
                body = await response.read()
                response.raise_for_status()
            nbytes += len(body)
            took = loop_hold_ms(response.headers.get("Server-Timing"))
            if took is not None:
                hold = max(hold or 0.0, took)
        return hold, nbytes

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()


def _in_process(host: Any) -> Callable[[], Awaitable[tuple[float | None, int]]]:
    from stepstream.ops.telemetry.metrics import Health, observability_for

    observability = observability_for(host, Health(lambda: True))

    async def scrape_once() -> tuple[float | None, int]:
        rendered = await observability.render()
        return rendered.loop_ms, len(rendered.body)

    return scrape_once


@contextlib.asynccontextmanager
async def scraping(
    interval_s: float | None, servers: list[str], host: Any
) -> AsyncIterator[Scraper | None]:
    """Scrape the session's engines every ``interval_s`` while the block runs (None: not
    at all): its subprocesses over HTTP, or the in-process engine directly."""
    if interval_s is None:
        yield None
        return
    http = _OverHttp(servers) if servers else None
    scraper = Scraper(interval_s, http or _in_process(host))
    task = asyncio.get_running_loop().create_task(scraper.run())
    try:
        yield scraper
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if http is not None:
            await http.close()
