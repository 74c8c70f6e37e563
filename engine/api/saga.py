"""Sagas: ``async with ctx.saga(name)`` is a rollback checkpoint.

A step run inside it with ``compensate=fn`` is noted when it starts. If an exception
leaves the block, the rollback first waits for those steps still running, then runs the
compensations of the ones that succeeded, newest first (by when each step was recorded
as started, which the history fixes, so a replay undoes in the order the first run did),
each a durable step (recorded, retried, never run again once it succeeded, so a crash in
the middle of compensating picks up where it was); then ``RolledBack`` is raised with the
exception as its cause. A compensation receives the result of the step it undoes. A
saga that ends without an exception hands its steps to the saga around it, if any.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from stepstream.engine.api.retry import RetryPolicy
from stepstream.engine.api.runtime import WorkflowRuntime
from stepstream.engine.errors import RolledBack, StepFailed
from stepstream.engine.wire.codec import error_message

# Compensation steps retry far longer than ordinary ones: giving up leaves work undone.
COMPENSATION_RETRY = RetryPolicy(max_attempts=10, initial_interval=1.0, max_interval=60.0)


@dataclass(slots=True)
class _Compensation:
    key: str  # the replay key of the step it undoes
    fn: Callable[..., Any]
    outcome: asyncio.Future[Any]  # the step's: its value, or its failure


@dataclass(slots=True)
class SagaFrame:
    key: str
    begun: list[_Compensation] = field(default_factory=list)


current_saga: ContextVar[SagaFrame | None] = ContextVar("stepstream_saga", default=None)


def register(
    key: str, fn: Callable[..., Any], outcome: asyncio.Future[Any], frame: SagaFrame
) -> None:
    """Note a compensable step as it starts: a rollback waits for its ``outcome``."""
    frame.begun.append(_Compensation(key, fn, outcome))


def hand_over(frame: SagaFrame, outer: SagaFrame | None) -> None:
    """A saga that ended well: its steps are the enclosing saga's to undo."""
    if outer is not None:
        outer.begun.extend(frame.begun)


async def _succeeded(rt: WorkflowRuntime, frame: SagaFrame) -> list[tuple[_Compensation, Any]]:
    """The frame's steps that succeeded, newest first, once none is still running."""
    running = [c.outcome for c in frame.begun if not c.outcome.done()]
    if running:
        await asyncio.wait(running)
    done = [
        (comp, comp.outcome.result())
        for comp in frame.begun
        if not comp.outcome.cancelled() and comp.outcome.exception() is None
    ]
    # Newest by when the history recorded each start: the order the code reached the
    # starts in can differ between a run and its replay when steps run side by side.
    done.reverse()
    done.sort(key=lambda pair: rt.recorded_at(pair[0].key), reverse=True)
    return done


async def roll_back(rt: WorkflowRuntime, frame: SagaFrame, cause: BaseException) -> RolledBack:
    """Run the compensations of the frame's steps that succeeded, newest first, each as a
    durable step; the error to raise (compensations that failed for good are listed)."""
    failed: dict[str, StepFailed] = {}
    undo = await _succeeded(rt, frame)
    for comp, result in undo:
        # Named for the step it undoes (a step key is never a scope, so this is free).
        key = f"{comp.key}/undo"
        try:
            await rt.step_future(key, comp.fn, (result,), {}, COMPENSATION_RETRY, None)
        except StepFailed as exc:
            failed[comp.key] = exc
    undone = ", ".join(comp.key for comp, _ in undo) or "nothing"
    why = f"{type(cause).__name__}: {error_message(cause)}"
    message = f"saga {frame.key!r} rolled back ({undone}) after {why}"
    if failed:
        message += f"; compensations that failed: {', '.join(failed)}"
    return RolledBack(message, cause=cause, compensation_errors=failed)
