"""Workflows with queues for the queue tests (loaded by in-process engines, `stepstream
dev` and `stepstream worker` alike)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from stepstream import Context, Queue, RetryPolicy, workflow

pool = Queue("pool", concurrency=5)
paced = Queue("paced", rate=(10, 0.5))
single = Queue("single", concurrency=1)
tenants = Queue("tenants", concurrency=1, per_key=True)
api = Queue("api", concurrency=2)
partner = Queue("partner", concurrency=1)


async def work(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


@workflow("pooled", queue=pool)
async def pooled(ctx: Context, seconds: float) -> float:
    return await ctx.step("work", work, seconds)


@workflow("paced", queue=paced)
async def paced_run(ctx: Context, _: Any) -> str:
    return ctx.instance_id


@workflow("gate", queue=single)
async def gate(ctx: Context, _: Any) -> str:
    """Holds its slot of ``single`` until it gets the event ``go``."""
    await ctx.wait_for_event("go")
    return ctx.instance_id


@workflow("quick", queue=single)
async def quick(ctx: Context, _: Any) -> str:
    return ctx.instance_id


@workflow("tenant", queue=tenants)
async def tenant(ctx: Context, _: Any) -> str:
    await ctx.wait_for_event("go")
    return ctx.instance_id


@workflow("long-named-call")
async def long_named_call(ctx: Context, name_length: int) -> float:
    """A queued step with a name of ``name_length`` characters."""
    result: float = await ctx.step("n" * name_length, work, 0, queue=api)
    return result


@workflow("calls")
async def calls(ctx: Context, count: int) -> list[float]:
    """``count`` steps at once, each within a slot of ``api``."""
    return list(
        await asyncio.gather(*(ctx.step("call", work, 0.03, queue=api) for _ in range(count)))
    )


@workflow("picky", queue=single)
async def picky(ctx: Context, value: str) -> str:
    if value == "bad":
        raise ValueError("bad input")
    return value


def partner_call(ledger: str, name: str, fail_first: bool) -> str:
    """Notes each attempt (who, start and end ms, outcome) in ``ledger``; the first
    attempt fails when ``fail_first``."""
    path = Path(ledger)
    attempt = (
        1 + sum(1 for line in path.read_text().splitlines() if json.loads(line)["name"] == name)
        if path.exists()
        else 1
    )
    started = time.time() * 1000
    time.sleep(0.1)
    failed = fail_first and attempt == 1
    with path.open("a") as out:
        row = {"name": name, "attempt": attempt, "start": started, "end": time.time() * 1000}
        out.write(json.dumps({**row, "ok": not failed}) + "\n")
    if failed:
        raise ConnectionError("partner busy")
    return name


@workflow("partner")
async def partner_run(ctx: Context, args: dict[str, Any]) -> str:
    """One call of ``partner_call`` in a slot of ``partner`` (concurrency 1), retried
    after 1.5 s."""
    return await ctx.step(
        "call",
        partner_call,
        args["ledger"],
        ctx.instance_id,
        bool(args.get("fail_first")),
        queue=partner,
        retry=RetryPolicy(max_attempts=3, initial_interval=1.5),
    )


def stamp(ledger: str, name: str) -> str:
    """Notes ``name`` and when it ran (start and end ms) in ``ledger``."""
    started = time.time() * 1000
    time.sleep(0.05)
    with Path(ledger).open("a") as out:
        out.write(json.dumps({"name": name, "start": started, "end": time.time() * 1000}) + "\n")
    return name


@workflow("two-steps", queue=single)
async def two_steps(ctx: Context, ledger: str) -> list[str]:
    """Two steps in the one slot of ``single``."""
    first = await ctx.step("first", stamp, ledger, f"{ctx.instance_id}/first")
    second = await ctx.step("second", stamp, ledger, f"{ctx.instance_id}/second")
    return [first, second]


@workflow("fails-once", queue=single)
async def fails_once(ctx: Context, ledger: str) -> str:
    """In the one slot of ``single``, a step that fails for good the first time it runs."""
    return await ctx.step(
        "call",
        partner_call,
        ledger,
        ctx.instance_id,
        True,
        retry=RetryPolicy(max_attempts=1),
    )


@workflow("code-fails", queue=single)
async def code_fails(ctx: Context, args: dict[str, str]) -> list[str]:
    """In the one slot of ``single``: a step, then code that raises until the file
    ``args["fixed"]`` exists (a fix deployed), then another step."""
    first = await ctx.step("first", stamp, args["ledger"], f"{ctx.instance_id}/first")
    if not Path(args["fixed"]).exists():
        raise ValueError("a bug in the code")
    second = await ctx.step("second", stamp, args["ledger"], f"{ctx.instance_id}/second")
    return [first, second]


@workflow("two-gates")
async def two_gates(ctx: Context, _: Any) -> list[Any]:
    """Two waits for the same event name at once: each takes one event, oldest first."""
    return list(
        await asyncio.gather(
            ctx.wait_for_event("go", key="go-a"), ctx.wait_for_event("go", key="go-b")
        )
    )


@workflow("timed-gate")
async def timed_gate(ctx: Context, timeout: float) -> Any:
    return await ctx.wait_for_event("go", timeout=timeout)
