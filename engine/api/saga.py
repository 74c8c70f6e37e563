"""Sagas: ``async with ctx.saga(name)`` is a rollback checkpoint.

Steps run inside it with ``compensate=fn`` register ``fn`` once they succeed. If an
exception leaves the block, the compensations of the steps completed in it run newest
first, each a durable step (recorded, retried, never run again once it succeeded, so a
crash in the middle of compensating picks up where it was), then ``RolledBack`` is
raised with the exception as its cause. A compensation receives the result of the step
it undoes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from stepstream.engine.api.retry import RetryPolicy
from stepstream.engine.api.runtime import WorkflowRuntime
from stepstream.engine.errors import RolledBack, StepFailed

# Compensation steps retry far longer than ordinary ones: giving up leaves work undone.
COMPENSATION_RETRY = RetryPolicy(max_attempts=10, initial_interval=1.0, max_interval=60.0)


@dataclass(slots=True)
class _Compensation:
    key: str  # the replay key of the step it undoes
    fn: Callable[..., Any]
    result: Any


@dataclass(slots=True)
class SagaFrame:
    key: str
    done: list[_Compensation] = field(default_factory=list)


current_saga: ContextVar[SagaFrame | None] = ContextVar("stepstream_saga", default=None)


def register(key: str, fn: Callable[..., Any], result: Any, frame: SagaFrame) -> None:
    frame.done.append(_Compensation(key, fn, result))


async def roll_back(rt: WorkflowRuntime, frame: SagaFrame, cause: BaseException) -> RolledBack:
    """Run the frame's compensations newest first, each as a durable step; the error to
    raise (compensations that failed for good are listed on it)."""
    failed: dict[str, StepFailed] = {}
    for comp in reversed(frame.done):
        # Named for the step it undoes (a step key is never a scope, so this is free).
        key = f"{comp.key}/undo"
        try:
            await rt.step_future(key, comp.fn, (comp.result,), {}, COMPENSATION_RETRY, None)
        except StepFailed as exc:
            failed[comp.key] = exc
    undone = ", ".join(c.key for c in reversed(frame.done)) or "nothing"
    message = f"saga {frame.key!r} rolled back ({undone}) after {type(cause).__name__}: {cause}"
    if failed:
        message += f"; compensations that failed: {', '.join(failed)}"
    return RolledBack(message, cause=cause, compensation_errors=failed)
