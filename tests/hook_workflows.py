"""Workflows with hooks, for the hook tests (importable by worker subprocesses too).

Every hook call appends one JSON line to ``$STEPSTREAM_TEST_HOOKS/hooks.jsonl`` (the
event's fields, plus ``hook``: ``error``, ``status``, ``raising-error``,
``raising-status``, ``slow-begin`` or ``slow-end``), so a test in another process can
see which calls were made and how often."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from stepstream import (
    Context,
    Queue,
    RetryPolicy,
    StatusChangeEvent,
    StepErrorEvent,
    StepFailed,
    workflow,
)

_write = threading.Lock()


def note(hook: str, event: StepErrorEvent | StatusChangeEvent) -> None:
    root = os.environ.get("STEPSTREAM_TEST_HOOKS")
    if not root:
        return
    fields = {
        k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(event).items()
    }
    line = json.dumps({"hook": hook, **fields}) + "\n"
    with _write, open(Path(root) / "hooks.jsonl", "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_notes(root: Path) -> list[dict[str, Any]]:
    path = root / "hooks.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def alert(event: StepErrorEvent) -> None:  # sync: runs on a hook thread
    note("error", event)


async def audit(event: StatusChangeEvent) -> None:  # async: runs on the loop
    await asyncio.sleep(0)
    note("status", event)


def fails_until(ctx: Context, succeed_on: int) -> int:
    if ctx.attempt < succeed_on:
        raise RuntimeError(f"attempt {ctx.attempt} fails")
    return ctx.attempt


def always_fails(ctx: Context) -> None:
    raise ValueError(f"no luck on attempt {ctx.attempt}")


@workflow("hooked", on_error=alert, on_status_change=audit)
async def hooked(ctx: Context, _: Any) -> dict[str, Any]:
    """A step that fails twice then succeeds, and one that uses up its two attempts."""
    flaky = await ctx.step(
        "flaky", fails_until, ctx, 3, retry=RetryPolicy(max_attempts=5, initial_interval=0.05)
    )
    try:
        await ctx.step(
            "doomed", always_fails, ctx, retry=RetryPolicy(max_attempts=2, initial_interval=0.01)
        )
    except StepFailed:
        pass
    return {"flaky": flaky}


@workflow("hooked-waiter", on_error=alert, on_status_change=audit)
async def hooked_waiter(ctx: Context, _: Any) -> Any:
    """A step that fails once, then a wait for "go": to pause, resume and cancel it."""
    await ctx.step("warm", fails_until, ctx, 2, retry=RetryPolicy(initial_interval=0.01))
    return await ctx.wait_for_event("go")


@workflow("hooked-queued", on_status_change=audit, queue=Queue("hooked-desk", concurrency=1))
async def hooked_queued(ctx: Context, _: Any) -> Any:
    """One at a time: a second waits, pending, for the first's slot."""
    return await ctx.wait_for_event("go")


@workflow("hooked-failing", on_status_change=audit)
async def hooked_failing(ctx: Context, _: Any) -> None:
    await ctx.step("fine", fails_until, ctx, 1)
    raise RuntimeError("boom")


def raising_alert(event: StepErrorEvent) -> None:
    note("raising-error", event)
    raise RuntimeError("the alerting service is down")


async def raising_audit(event: StatusChangeEvent) -> None:
    note("raising-status", event)
    raise RuntimeError("the audit log is down")


@workflow("hooked-raising", on_error=raising_alert, on_status_change=raising_audit)
async def hooked_raising(ctx: Context, n: int) -> int:
    value: int = await ctx.step(
        "flaky", fails_until, ctx, 2, retry=RetryPolicy(initial_interval=0.01)
    )
    return value + n


def slow_audit(event: StatusChangeEvent) -> None:
    """Slow on completion for ``$STEPSTREAM_TEST_HOOK_SLEEP`` seconds: a process can be
    killed while it runs."""
    if event.new_status != "completed":
        return
    note("slow-begin", event)
    time.sleep(float(os.environ.get("STEPSTREAM_TEST_HOOK_SLEEP", "0")))
    note("slow-end", event)


@workflow("hooked-slow", on_status_change=slow_audit)
async def hooked_slow(ctx: Context, n: int) -> int:
    value: int = await ctx.step("one", fails_until, ctx, 1)
    return value + n


def mark(instance_id: str, name: str) -> None:
    """A line that is not a hook call: what a step body did."""
    root = os.environ.get("STEPSTREAM_TEST_HOOKS")
    if root:
        with _write, open(Path(root) / "hooks.jsonl", "a") as f:
            f.write(json.dumps({"hook": "mark", "instance_id": instance_id, "name": name}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def long_first_attempt(ctx: Context) -> int:
    """Runs for ``$STEPSTREAM_TEST_STEP_SLEEP`` seconds on its first attempt: a process
    can be killed while it runs, and the attempt is lost."""
    mark(ctx.instance_id, f"long-{ctx.attempt}")
    if ctx.attempt == 1:
        time.sleep(float(os.environ.get("STEPSTREAM_TEST_STEP_SLEEP", "0")))
    return ctx.attempt


@workflow("hooked-lost", on_error=alert, on_status_change=audit)
async def hooked_lost(ctx: Context, _: Any) -> int:
    value: int = await ctx.step("long", long_first_attempt, ctx)
    return value
