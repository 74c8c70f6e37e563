"""The workflow of the crash checker (``tests/faults/test_crash_checker.py``).

Importable by worker subprocesses (``--workflows tests.crash_workflows``, with the
repository on ``PYTHONPATH``). One workflow, ``crash-plan``, runs the plan it is given
as input, so that a seeded generator in the test decides every instance's shape:

``{"ops": [op, ...]}``, each op one of

- ``{"op": "step", "key": K, "max": M, "fail": F, "seconds": S, "async": bool}``: a step
  with ``RetryPolicy(max_attempts=M)`` whose body takes S seconds and raises on attempts
  1..F (so it succeeds on attempt F+1 if M allows, else ``StepFailed`` is caught);
- ``{"op": "gather", "steps": [step op, ...]}``: those steps in parallel;
- ``{"op": "sleep", "key": K, "seconds": S}``;
- ``{"op": "wait", "key": K, "event": NAME, "timeout": S | None}``: ``wait_for_event``;
  a timeout is caught.

The result is one entry per op: ``{"key", "attempt"}`` of a step's successful attempt,
``{"failed": attempts}``, ``"slept"``, the event's payload or ``"timeout"``.

Every step body appends ``<key> <attempt> <pid> <start|fail|end> <time>`` to the file
``$STEPSTREAM_CRASH_LEDGER/<instance id>`` (with fsync), so the test sees how often, by
which process and for which recorded attempt a body really ran.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from stepstream import Context, EventTimeout, RetryPolicy, StepFailed, workflow

LEDGER_ENV = "STEPSTREAM_CRASH_LEDGER"


def ledger_line(instance: str, key: str, attempt: int, what: str) -> None:
    root = os.environ.get(LEDGER_ENV)
    if not root:
        return
    line = f"{key} {attempt} {os.getpid()} {what} {time.time():.3f}\n".encode()
    fd = os.open(Path(root) / instance, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_ledger(root: Path, instance: str) -> list[tuple[str, int, int, str, float]]:
    """The lines a ledger file holds: (key, attempt, pid, what, time)."""
    path = root / instance
    if not path.exists():
        return []
    lines = []
    for raw in path.read_text().splitlines():
        parts = raw.split()
        if len(parts) != 5:
            continue  # the process was killed in the middle of the write
        key, attempt, pid, what, at = parts
        lines.append((key, int(attempt), int(pid), what, float(at)))
    return lines


async def _step(ctx: Context, op: dict[str, Any]) -> Any:
    key: str = op["key"]
    fail: int = op["fail"]
    seconds: float = op["seconds"]
    instance = ctx.instance_id

    def check(attempt: int) -> dict[str, Any]:
        if attempt <= fail:
            ledger_line(instance, key, attempt, "fail")
            raise RuntimeError(f"{key}: attempt {attempt} fails on purpose")
        ledger_line(instance, key, attempt, "end")
        return {"key": key, "attempt": attempt}

    def sync_body() -> dict[str, Any]:
        attempt = ctx.attempt
        ledger_line(instance, key, attempt, "start")
        time.sleep(seconds)
        return check(attempt)

    async def async_body() -> dict[str, Any]:
        attempt = ctx.attempt
        ledger_line(instance, key, attempt, "start")
        await asyncio.sleep(seconds)
        return check(attempt)

    policy = RetryPolicy(
        max_attempts=op["max"], initial_interval=0.05, backoff=2.0, max_interval=0.4
    )
    try:
        return await ctx.step(key, async_body if op["async"] else sync_body, retry=policy)
    except StepFailed as exc:
        return {"failed": exc.attempts}


@workflow("crash-plan")
async def crash_plan(ctx: Context, plan: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for op in plan["ops"]:
        kind = op["op"]
        if kind == "step":
            out.append(await _step(ctx, op))
        elif kind == "gather":
            out.append(list(await asyncio.gather(*(_step(ctx, s) for s in op["steps"]))))
        elif kind == "sleep":
            await ctx.sleep(op["key"], op["seconds"])
            out.append("slept")
        elif kind == "wait":
            try:
                out.append(
                    await ctx.wait_for_event(op["event"], key=op["key"], timeout=op["timeout"])
                )
            except EventTimeout:
                out.append("timeout")
        else:
            raise ValueError(f"unknown op {kind!r}")
    return out
