"""The bench's workflows and its three standard workloads, driven through any ``Client``.

W1: N instances x 10 sequential steps started at once, results awaited (throughput and
    latency), plus single-instance latency of a 10-step and a 100-step workflow run one
    at a time.
W2: N one-second sleepers started at once (timer lateness: when the sleep was recorded
    as elapsed, minus when it was due; a negative lateness is an early fire, counted;
    and as the client sees it: result seen minus start called plus one second, with
    its two other parts: start called -> sleep recorded, sleep elapsed -> result seen).
W3: N instances waiting for an event a client sends (event sent -> result seen).

Every workload only uses the public client calls, so the same code measures the
in-process, ``http://`` and ``kafka://`` client paths.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from stepstream.engine.api.context import Context
from stepstream.engine.api.loops import Break, Continue
from stepstream.engine.api.workflow import workflow
from stepstream.producers.client import Client

DEFAULT_N = {"W1": 2000, "W2": 2000, "W3": 500, "buffer": 1000, "fanout": 4000, "loop": 1000}
# Waits longer than any workload takes on a loaded machine: a result that does not come
# is a failure of the run, not a figure.
RESULT_TIMEOUT_S = 600
# Each process's CPU seconds so far, by role (``client``, ``engine``, ``worker<i>``...).
CpuReader = Callable[[], dict[str, float]]


async def _noop(i: int) -> int:
    return i + 1


def _noop_sync(i: int) -> int:
    return i + 1


@workflow("bench-steps")
async def bench_steps(ctx: Context, args: dict[str, Any]) -> int:
    fn = _noop_sync if args.get("sync") else _noop
    value = 0
    for i in range(args["steps"]):
        value = await ctx.step(f"s{i}", fn, value)
    return value


@workflow("bench-sleep")
async def bench_sleep(ctx: Context, seconds: float) -> None:
    await ctx.sleep("nap", seconds)


@workflow("bench-event")
async def bench_event(ctx: Context, _: Any) -> Any:
    return await ctx.wait_for_event("go")


FANOUT_SLEEP_S = 0.2


@workflow("bench-leaf")
async def bench_leaf(ctx: Context, i: int) -> int:
    return i + 1


@workflow("bench-fanout")
async def bench_fanout(ctx: Context, args: dict[str, Any]) -> int:
    """``n`` steps, sleeps or child workflows at once (one gather), summed: steps and
    children give i + 1 for the i-th, a sleep 1."""
    n: int = args["n"]
    kind: str = args["kind"]
    if kind == "sleeps":
        await asyncio.gather(*(ctx.sleep(f"z{i}", FANOUT_SLEEP_S) for i in range(n)))
        return n
    if kind == "children":
        handles = [await ctx.start_child("bench-leaf", i, name=f"c{i}") for i in range(n)]
        results: list[int] = await asyncio.gather(*(h.result() for h in handles))
        return sum(results)
    return sum(await asyncio.gather(*(ctx.step(f"s{i}", _noop, i) for i in range(n))))


@workflow("bench-drain")
async def bench_drain(ctx: Context, n: int) -> int:
    """Waits for "go": the ``n`` "item" events sent before it wait in its buffer."""
    await ctx.wait_for_event("go")
    for i in range(n):
        await ctx.wait_for_event("item", key=f"item-{i}")
    return n


@workflow("bench-loop")
async def bench_loop(ctx: Context, args: dict[str, Any]) -> dict[str, int]:
    """``before`` steps, then a ``ctx.loop`` of ``n`` iterations of one step each (the
    default ``keep``: older iterations are pruned as it goes). Returns how long the loop
    took, between two recorded clock readings."""
    for i in range(args["before"]):
        await ctx.step(f"s{i}", _noop, i)
    n: int = args["n"]

    async def body(ctx: Context, count: int) -> Break[int] | Continue[int]:
        count = await ctx.step("tick", _noop, count)
        return Break(count) if count >= n else Continue(count)

    began = ctx.now()
    count = await ctx.loop("count", body, state=0)
    return {"iterations": count, "loop_ms": int((ctx.now() - began).total_seconds() * 1000)}


@workflow("bench-timer")
async def bench_timer(ctx: Context, wake_at_ms: int) -> None:
    await ctx.sleep_until("due", datetime.fromtimestamp(wake_at_ms / 1000, tz=UTC))


# Every workflow the workloads start, for the engines that run them.
WORKFLOWS = (
    bench_steps,
    bench_sleep,
    bench_event,
    bench_timer,
    bench_drain,
    bench_fanout,
    bench_leaf,
    bench_loop,
)


def pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))
    return round(ordered[index], 2)


class Progress:
    """``label: done/total`` on stderr, at most once a second."""

    def __init__(self, label: str, total: int) -> None:
        self._label, self._total, self._done, self._last = label, total, 0, 0.0

    def tick(self) -> None:
        self.advance_to(self._done + 1)

    def advance_to(self, done: int) -> None:
        self._done = done
        now = time.monotonic()
        if now - self._last > 1.0 or self._done == self._total:
            self._last = now
            print(f"{self._label}: {self._done}/{self._total}", file=sys.stderr, flush=True)


async def gather_limited(jobs: list[Callable[[], Awaitable[Any]]], limit: int) -> list[Any]:
    """Run the jobs, at most ``limit`` at a time, and return their results in order.
    ``limit`` workers take the jobs in turn: no task or coroutine exists for a job before
    it runs, so a million jobs cost no more memory than ``limit`` (the timer workload
    reports the engine's memory, which in process includes this one's)."""
    results: list[Any] = [None] * len(jobs)
    queue = iter(enumerate(jobs))

    async def worker() -> None:
        me = asyncio.current_task()
        for index, job in queue:
            results[index] = await job()
            # Stopped (Ctrl-C, SIGTERM): take no more jobs, even if a job's own code let
            # the cancel go by (Python 3.11's wait_for loses one that lands as the awaited
            # call completes), or one worker would go on through all the rest.
            if me is not None and me.cancelling():
                raise asyncio.CancelledError

    await asyncio.gather(*(worker() for _ in range(min(limit, len(jobs)))))
    return results


async def w1(
    client: Client,
    n: int,
    *,
    sync: bool,
    input_bytes: int = 0,
    cpu: CpuReader | None = None,
) -> dict[str, Any]:
    """``input_bytes``: a string of that many bytes in each instance's input (the engine
    stores an input once, not at every step). ``cpu``: each process's CPU seconds so far,
    read before and after the burst (``burst_cpu_s``: who the timed part kept busy)."""
    steps = 10
    padding = {"pad": "x" * input_bytes} if input_bytes else {}
    progress = Progress("W1", n)
    latencies: list[float] = []
    completed = 0

    async def one(i: int) -> None:
        nonlocal completed
        t0 = time.perf_counter()
        instance = await client.start(
            "bench-steps", {"steps": steps, "sync": sync, **padding}, instance_id=f"w1-{i}"
        )
        value = await client.result(instance, timeout=RESULT_TIMEOUT_S)
        if value != steps:
            raise SystemExit(f"bench: {instance} returned {value!r}, expected {steps}")
        latencies.append((time.perf_counter() - t0) * 1000)
        completed += 1
        progress.tick()

    before = cpu() if cpu is not None else {}
    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - start
    after = cpu() if cpu is not None else {}
    burst = {role: round(after[role] - before[role], 2) for role in after}

    async def single(prefix: str, count: int, steps: int) -> list[float]:
        out = []
        for i in range(count):
            t0 = time.perf_counter()
            instance = await client.start(
                "bench-steps",
                {"steps": steps, "sync": sync, **padding},
                instance_id=f"{prefix}-{i}",
            )
            await client.result(instance, timeout=RESULT_TIMEOUT_S)
            out.append((time.perf_counter() - t0) * 1000)
        return out

    single10 = await single("w1-single10", 50, 10)
    single100 = await single("w1-single100", 10, 100)
    per_step_10 = pct(single10, 50) / 10
    per_step_100 = pct(single100, 50) / 100
    return {
        "workflows": n,
        "completed": completed,
        "steps_per_workflow": steps,
        "elapsed_s": round(elapsed, 3),
        "steps_per_s": round(n * steps / elapsed, 1),
        "workflows_per_s": round(n / elapsed, 1),
        "latency_p50_ms": pct(latencies, 50),
        "latency_p99_ms": pct(latencies, 99),
        "single_10_steps_p50_ms": pct(single10, 50),
        "single_100_steps_p50_ms": pct(single100, 50),
        "per_step_ratio_100_vs_10": round(per_step_100 / per_step_10, 2) if per_step_10 else None,
        "step_bodies": "sync (thread pool)" if sync else "async",
        "input_bytes": input_bytes,
        **({"burst_cpu_s": burst} if cpu is not None else {}),
    }


async def sleep_timeline(client: Client, instance: str) -> tuple[float, float, float]:
    """(scheduled, due, woke) in ms since the epoch, from the instance's history: when its
    sleep was recorded as started, when it was due, when it was recorded as elapsed."""
    history = await client.history(instance)
    started = next(h for h in history if h.type == "SleepStarted")
    woke = next(h for h in history if h.type == "SleepElapsed")
    return (
        datetime.fromisoformat(started.time).timestamp() * 1000,
        float(started.attributes["wake_at_ms"]),
        datetime.fromisoformat(woke.time).timestamp() * 1000,
    )


def lateness_figures(lateness: list[float]) -> dict[str, Any]:
    return {
        "lateness_p50_ms": pct(lateness, 50),
        "lateness_p99_ms": pct(lateness, 99),
        "lateness_min_ms": round(min(lateness), 2) if lateness else None,
        "lateness_max_ms": round(max(lateness), 2) if lateness else None,
        # A timer must never fire before it is due: anything here is a bug, not a figure.
        "early_fires": sum(1 for x in lateness if x < 0),
    }


async def w2(client: Client, n: int) -> dict[str, Any]:
    seconds = 1.0
    progress = Progress("W2", n)
    called: dict[str, float] = {}
    seen: dict[str, float] = {}

    async def one(i: int) -> None:
        called[f"w2-{i}"] = time.time() * 1000
        instance = await client.start("bench-sleep", seconds, instance_id=f"w2-{i}")
        await client.result(instance, timeout=RESULT_TIMEOUT_S)
        seen[instance] = time.time() * 1000
        progress.tick()

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - start

    def reader(instance: str) -> Callable[[], Awaitable[tuple[float, float, float]]]:
        return lambda: sleep_timeline(client, instance)

    ids = list(seen)
    timelines = await gather_limited([reader(i) for i in ids], 50)
    late_seen = [seen[i] - called[i] - seconds * 1000 for i in ids]
    way_in = [t[0] - called[i] for i, t in zip(ids, timelines, strict=True)]
    # The sleep counts from when the start was taken (docs/workflows.md, "Workflow
    # time"): its due time less the sleep.
    taken = [t[1] - seconds * 1000 - called[i] for i, t in zip(ids, timelines, strict=True)]
    way_out = [seen[i] - t[2] for i, t in zip(ids, timelines, strict=True)]
    return {
        "workflows": n,
        "completed": len(seen),
        "sleep_s": seconds,
        "workflows_per_s": round(n / elapsed, 1),
        "elapsed_s": round(elapsed, 3),
        **lateness_figures([woke - due for _, due, woke in timelines]),
        # As the client sees it: result seen minus (start called + the sleep). It adds
        # to the timer's lateness the wait for the start to be taken (called -> taken by
        # the log, when the sleep counts from) and the result's way out (sleep elapsed ->
        # result seen), split out below; "start to sleeping" is when the engine got to
        # the start (called -> sleep recorded), which the sleep no longer waits for.
        "client_lateness_p50_ms": pct(late_seen, 50),
        "client_lateness_p99_ms": pct(late_seen, 99),
        "start_taken_p99_ms": pct(taken, 99),
        "start_to_sleeping_p99_ms": pct(way_in, 99),
        "elapsed_to_result_p99_ms": pct(way_out, 99),
    }


def _starter(client: Client, workflow: str, instance: str) -> Callable[[], Awaitable[str]]:
    return lambda: client.start(workflow, None, instance_id=instance)


async def w3(client: Client, n: int) -> dict[str, Any]:
    progress = Progress("W3 waiting", n)
    ids = [f"w3-{i}" for i in range(n)]
    await gather_limited([_starter(client, "bench-event", i) for i in ids], 200)
    for instance in ids:
        while not (await client.status(instance)).waits:
            await asyncio.sleep(0.005)
        progress.tick()
    latencies: list[float] = []
    done = Progress("W3 events", n)
    completed = 0

    async def one(instance: str) -> None:
        nonlocal completed
        t0 = time.perf_counter()
        await client.send_event(instance, "go", {"at": t0})
        await client.result(instance, timeout=RESULT_TIMEOUT_S)
        latencies.append((time.perf_counter() - t0) * 1000)
        completed += 1
        done.tick()

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in ids))
    elapsed = time.perf_counter() - start
    return {
        "workflows": n,
        "completed": completed,
        "workflows_per_s": round(n / elapsed, 1),
        "event_to_completion_p50_ms": pct(latencies, 50),
        "event_to_completion_p99_ms": pct(latencies, 99),
        "latency_p50_ms": pct(latencies, 50),
        "latency_p99_ms": pct(latencies, 99),
    }


async def buffer(client: Client, n: int, *, input_bytes: int = 0) -> dict[str, Any]:
    """N events sent one after another to one instance that does not ask for them yet
    (each waits in its buffer), then taken all at once: what an instance's growing buffer
    costs each event that comes (it must not grow with the buffer)."""
    instance = await client.start("bench-drain", n, instance_id="buffer-0")
    padding = {"pad": "x" * input_bytes} if input_bytes else {}
    progress = Progress("buffer", n)
    sends: list[float] = []
    start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        await client.send_event(instance, "item", {"i": i, **padding})
        sends.append((time.perf_counter() - t0) * 1000)
        progress.tick()
    elapsed = time.perf_counter() - start
    buffered = (await client.status(instance)).buffered_events
    t0 = time.perf_counter()
    await client.send_event(instance, "go", None)
    taken = await client.result(instance, timeout=RESULT_TIMEOUT_S)
    drained = time.perf_counter() - t0
    if taken != n:
        raise SystemExit(f"bench: {instance} took {taken!r} events, expected {n}")
    tenth = max(n // 10, 1)
    return {
        "workflows": 1,
        "completed": 1,
        "events": n,
        "buffered_before_go": buffered,
        "events_per_s": round(n / elapsed, 1),
        "send_p50_ms": pct(sends, 50),
        "send_p99_ms": pct(sends, 99),
        # The same figure while the buffer was small and when it was full.
        "send_first_tenth_p50_ms": pct(sends[:tenth], 50),
        "send_last_tenth_p50_ms": pct(sends[-tenth:], 50),
        "drain_s": round(drained, 3),
        "input_bytes": input_bytes,
    }


async def fanout(client: Client, n: int) -> dict[str, Any]:
    """One instance runs N steps at once, another N sleeps, another N child workflows:
    what each costs while thousands of its siblings are open (it must not grow with
    them). Sleeps last ``FANOUT_SLEEP_S``; the time past it is the engine's."""
    figures: dict[str, Any] = {"workflows": 3, "completed": 0, "n": n}
    for kind in ("steps", "sleeps", "children"):
        start = time.perf_counter()
        instance = await client.start(
            "bench-fanout", {"n": n, "kind": kind}, instance_id=f"fanout-{kind}"
        )
        total = await client.result(instance, timeout=RESULT_TIMEOUT_S)
        elapsed = time.perf_counter() - start
        expected = n if kind == "sleeps" else n * (n + 1) // 2
        if total != expected:
            raise SystemExit(f"bench: {instance} returned {total!r}, expected {expected}")
        figures["completed"] += 1
        figures[f"{kind}_elapsed_s"] = round(elapsed, 3)
        if kind == "sleeps":
            figures["sleep_s"] = FANOUT_SLEEP_S
        else:
            figures[f"{kind}_per_s"] = round(n / elapsed, 1)
    return figures


async def loop(client: Client, n: int) -> dict[str, Any]:
    """One instance runs N loop iterations; another first runs 2N steps, then the same
    loop: an iteration must cost the same whatever else its instance holds."""
    figures: dict[str, Any] = {"workflows": 2, "completed": 0, "iterations": n}
    for label, before in (("alone", 0), ("after_steps", 2 * n)):
        instance = await client.start(
            "bench-loop", {"before": before, "n": n}, instance_id=f"loop-{label}"
        )
        result = await client.result(instance, timeout=RESULT_TIMEOUT_S)
        if result["iterations"] != n:
            raise SystemExit(f"bench: {instance} returned {result!r}, expected {n} iterations")
        figures["completed"] += 1
        figures[f"iterations_per_s_{label}"] = round(n / max(result["loop_ms"], 1) * 1000, 1)
    figures["steps_before"] = 2 * n
    return figures


async def run_workload(
    client: Client,
    name: str,
    count: int,
    sync: bool,
    input_bytes: int = 0,
    cpu: CpuReader | None = None,
) -> dict[str, Any]:
    if name == "W1":
        return await w1(client, count, sync=sync, input_bytes=input_bytes, cpu=cpu)
    if name == "W2":
        return await w2(client, count)
    if name == "buffer":
        return await buffer(client, count, input_bytes=input_bytes)
    if name == "fanout":
        return await fanout(client, count)
    if name == "loop":
        return await loop(client, count)
    return await w3(client, count)
