"""Workflows for the step timeout tests: sync bodies that overrun their timeout, and
one that stops early when ``attempt_cancelled()`` turns True.

Bodies run in the test's process (embedded engine, or the in-process Kafka worker), so
module-level events release them and lists record what they saw.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict

from stepstream import Context, RetryPolicy, StepFailed, attempt_cancelled, workflow

# Far longer than any test: a body waiting this long is stuck until released.
STUCK_S = 120.0

_releases: defaultdict[str, threading.Event] = defaultdict(threading.Event)
# What bodies saw, per instance: for the test to read after the result.
seen: defaultdict[str, list[str]] = defaultdict(list)

ONCE = RetryPolicy(max_attempts=1)


def release(instance_id: str) -> None:
    """Let every stuck body of ``instance_id`` return."""
    _releases[instance_id].set()


def stuck(instance_id: str) -> str:
    _releases[instance_id].wait(STUCK_S)
    return "released"


def quick() -> str:
    return "quick"


@workflow("overrun-then-quick")
async def overrun_then_quick(ctx: Context, n: int) -> dict[str, object]:
    """``n`` sync bodies overrun a short timeout; a quick sync step still runs at once
    (within its own short timeout) after them."""

    async def attempt(name: str) -> str:
        try:
            return str(await ctx.step(name, stuck, ctx.instance_id, timeout=0.2, retry=ONCE))
        except StepFailed as exc:
            return exc.error_type

    outcomes = await asyncio.gather(*(attempt(f"stuck-{i}") for i in range(n)))
    fast = await ctx.step("quick", quick, timeout=2.0, retry=ONCE)
    return {"stuck": sorted(set(outcomes)), "quick": fast}


def polite(instance_id: str) -> str:
    """First attempt: runs until its attempt is given up, then stops early."""
    from stepstream.engine.api.attempts import attempt_number

    attempt = attempt_number()
    if attempt > 1:
        return f"attempt {attempt}"
    deadline = time.monotonic() + STUCK_S
    while time.monotonic() < deadline:
        if attempt_cancelled():
            seen[instance_id].append(f"attempt {attempt} cancelled")
            return "stopped early"  # discarded: the attempt already timed out
        time.sleep(0.01)
    seen[instance_id].append(f"attempt {attempt} ran to the end")
    return "too late"


@workflow("polite-timeout")
async def polite_timeout(ctx: Context, _: object) -> str:
    result: str = await ctx.step(
        "poll",
        polite,
        ctx.instance_id,
        timeout=0.2,
        retry=RetryPolicy(max_attempts=2, initial_interval=0),
    )
    return result
