"""The fixed-rate timer workload: many timers pending at once on one engine, firing at a
steady rate, for timer lateness under a standing index and the memory it holds.

``--pending N --rate R``: N instances each sleep until a time of their own, spaced
1/R s apart, so once the first one is due they fire at R per second for N/R seconds.
The first is due only after all N are scheduled (the lead is sized from the start rate
measured on a probe batch), so at that moment all N timers are pending. Lateness is,
per instance, when the sleep was recorded as elapsed minus when it was due.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from stepstream.ops.bench.scrape import Scraper, scraping
from stepstream.ops.bench.sessions import Session, rss_mb, server_gauge_total
from stepstream.ops.bench.workloads import (
    RESULT_TIMEOUT_S,
    Progress,
    gather_limited,
    lateness_figures,
    pct,
    sleep_timeline,
)
from stepstream.producers.client import Client

# Starts in flight at once while scheduling: enough to keep any client path busy.
_IN_FLIGHT = 500
# A second of the firing whose p99 lateness reaches this is counted as late (the goal).
_LATE_MS = 100.0


async def _start_rate(client: Client, count: int) -> float:
    """Instances the engine starts per second (a probe batch of no-step runs, each started
    and its result awaited). A start returns once it is durable, before the engine has
    applied it: on Kafka the broker takes starts several times faster than a worker
    applies them, so the client's rate alone would make the lead far too short."""

    def starter(i: int) -> Callable[[], Awaitable[None]]:
        async def one() -> None:
            instance = f"timers-probe-{i}"
            await client.start("bench-steps", {"steps": 0}, instance_id=instance)
            await client.result(instance, timeout=RESULT_TIMEOUT_S)

        return one

    began = time.perf_counter()
    await gather_limited([starter(i) for i in range(count)], _IN_FLIGHT)
    return count / (time.perf_counter() - began)


async def _until_engine_holds(session: Session, pending: int, first_due_ms: float) -> float | None:
    """Until the engine holds all ``pending`` timers (the sum of its partitions'
    ``stepstream_timers_pending``), with progress, or the first comes due; when it held
    them all (ms since the epoch), or None if it did not in time. Only engines that
    serve ``/metrics`` (subprocesses) are asked; in process the starts are applied as
    they are made, and None is returned at once."""
    if not session.servers:
        return None
    progress = Progress("timers pending on the engine", pending)
    while True:
        held = int(await server_gauge_total(session.servers, "stepstream_timers_pending"))
        progress.advance_to(min(held, pending))
        now_ms = time.time() * 1000
        if held >= pending:
            return now_ms
        if now_ms >= first_due_ms:
            print(
                f"timers: the first came due with {held} of {pending} pending on the engine",
                file=sys.stderr,
            )
            return None
        await asyncio.sleep(1.0)


def _p99_by_second(on_time: list[tuple[float, float]], first_due_ms: float) -> list[float]:
    """The p99 lateness of the timers due in each second of the firing, in due order."""
    seconds: list[list[float]] = []
    for due, woke in on_time:
        n = max(0, int((due - first_due_ms) // 1000))
        while len(seconds) <= n:
            seconds.append([])
        seconds[n].append(woke - due)
    return [pct(lateness, 99) for lateness in seconds]


async def fixed_rate_timers(
    session: Session, pending: int, rate: float, scrape_interval_s: float | None = None
) -> dict[str, Any]:
    """``scrape_interval_s``: scrape the engine's ``/metrics`` that often from the first
    start to the last timer's due time (``ops/bench/scrape.py``), reported as ``scrape``."""
    async with scraping(scrape_interval_s, session.servers, session.host) as scraper:
        figures = await _fixed_rate_timers(session, pending, rate, scraper)
    if scraper is not None:
        figures["scrape"] = scraper.figures()
    return figures


async def _fixed_rate_timers(
    session: Session, pending: int, rate: float, scraper: Scraper | None
) -> dict[str, Any]:
    client = session.client
    peak = rss_mb(session.engine_pids)
    before = peak
    sampling = True

    async def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, rss_mb(session.engine_pids))
            await asyncio.sleep(0.5)

    sampler = asyncio.get_running_loop().create_task(sample())
    try:
        start_rate = await _start_rate(client, min(1000, max(50, pending // 20)))
        # Twice what the probe says, and 5 s: a loaded machine has slower patches, and the
        # first timers must not come due while the engine still applies the last starts
        # (both would compete for it).
        lead_s = pending / start_rate * 2 + 5
        first_due_ms = time.time() * 1000 + lead_s * 1000
        print(
            f"timers: the engine starts {start_rate:.0f}/s; the first of {pending} is due "
            f"in {lead_s:.0f} s",
            file=sys.stderr,
        )
        due = [round(first_due_ms + i * 1000 / rate) for i in range(pending)]
        progress = Progress("timers scheduled", pending)

        def scheduler(i: int) -> Callable[[], Awaitable[None]]:
            async def one() -> None:
                await client.start("bench-timer", due[i], instance_id=f"timer-{i}")
                progress.tick()

            return one

        began = time.perf_counter()
        await gather_limited([scheduler(i) for i in range(pending)], _IN_FLIGHT)
        scheduled_s = time.perf_counter() - began
        all_pending_ms = time.time() * 1000
        engine_all_pending_ms = await _until_engine_holds(session, pending, first_due_ms)
        if engine_all_pending_ms is not None:
            all_pending_ms = engine_all_pending_ms
        elif session.servers:
            all_pending_ms = float("inf")  # the engine did not hold them all in time
        at_pending = rss_mb(session.engine_pids)
        if scraper is not None:
            scraper.idle_from = min(time.time(), first_due_ms / 1000)
            scraper.firing_from = first_due_ms / 1000
        done = Progress("timers fired", pending)

        def waiter(i: int) -> Callable[[], Awaitable[None]]:
            async def one() -> None:
                await client.result(f"timer-{i}", timeout=RESULT_TIMEOUT_S + pending / rate)
                done.tick()

            return one

        # Nothing asks the engine anything while the timers fire: what is measured is the
        # timer service under a standing index, not the client's waits (awaited during
        # the firing, 500 at a time, they took about a tenth of the engine loop's
        # samples). The results are awaited once the last timer is due.
        last_due_ms = due[-1]
        wait_s = (first_due_ms - time.time() * 1000) / 1000
        if wait_s > 0:
            print(f"timers: all pending, the first due in {wait_s:.0f} s", file=sys.stderr)
            await asyncio.sleep(wait_s)
        due_progress = Progress("timers due", pending)
        while (now_ms := time.time() * 1000) < last_due_ms:
            came_due = min(pending, int((now_ms - first_due_ms) * rate / 1000) + 1)
            due_progress.advance_to(came_due)
            await asyncio.sleep(min(1.0, (last_due_ms - now_ms) / 1000))
        due_progress.advance_to(pending)
        await gather_limited([waiter(i) for i in range(pending)], _IN_FLIGHT)
    finally:
        sampling = False
        await sampler
    reads = Progress("timers read", pending)

    def reader(i: int) -> Callable[[], Awaitable[tuple[float, float, float]]]:
        async def one() -> tuple[float, float, float]:
            got = await sleep_timeline(client, f"timer-{i}")
            reads.tick()
            return got

        return one

    timelines = await gather_limited([reader(i) for i in range(pending)], 50)
    # A timer scheduled after it was due says the lead was too short, not how the timer
    # service keeps time: those are counted and left out of the lateness.
    on_time = [(due, woke) for scheduled, due, woke in timelines if scheduled <= due]
    # In due order, so a backlog shows where it builds up and whether it drains.
    tenth = max(1, len(on_time) // 10)
    by_tenth = [
        pct([woke - due for due, woke in on_time[i : i + tenth]], 99)
        for i in range(0, tenth * 10, tenth)
        if on_time[i : i + tenth]
    ]
    by_second = _p99_by_second(on_time, first_due_ms)
    woke_all = sorted(woke for _, _, woke in timelines)
    fire_span_s = (woke_all[-1] - woke_all[0]) / 1000 if len(woke_all) > 1 else 0.0
    return {
        "pending": pending,
        "rate_per_s": rate,
        "start_rate_per_s": round(start_rate, 1),
        "scheduled_s": round(scheduled_s, 3),
        # Pending on the engine (subprocesses: from its /metrics), not only acknowledged.
        "all_pending_before_first_due": all_pending_ms <= first_due_ms,
        "all_pending_for_s": (
            round((first_due_ms - all_pending_ms) / 1000, 3)
            if all_pending_ms != float("inf")
            else None
        ),
        "scheduled_after_due": len(timelines) - len(on_time),
        "fired_per_s": round(pending / fire_span_s, 1) if fire_span_s else None,
        **lateness_figures([woke - due for due, woke in on_time]),
        "lateness_p99_ms_by_tenth": by_tenth,
        # Second n of the firing (timers due n to n+1 s after the first): where a stall
        # begins, how long it lasts and how fast it drains.
        "lateness_p99_ms_by_second": by_second,
        "late_seconds": sum(1 for p99 in by_second if p99 >= _LATE_MS),
        "rss_mb_before": before,
        "rss_mb_all_pending": at_pending,
        "rss_mb_peak": peak,
        "rss_of": "engine process" if len(session.engine_pids) == 1 else "engine processes",
    }
