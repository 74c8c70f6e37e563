"""What workflow hooks receive: ``@workflow(..., on_error=, on_status_change=)``.

A hook is a plain function of one event, sync (run on a hook thread) or async (run on
the engine's loop). It is called after the fact it reports is durable, never while a
workflow replays, and at least once (``consumers.hooks`` says how).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True, slots=True)
class StepErrorEvent:
    """A step attempt failed (``on_error``), one event per failed attempt, including
    attempts lost with a worker (``error_type`` ``AttemptLost``) and timeouts."""

    instance_id: str
    workflow: str
    version: str
    step: str  # the replay key: "charge", "charge#2", "shipping/label"
    attempt: int
    will_retry: bool  # False: the step failed for good and StepFailed reaches the workflow
    retry_at: datetime | None  # when the next attempt is due (UTC), None if there is none
    error_type: str
    message: str


@dataclass(frozen=True, slots=True)
class StatusChangeEvent:
    """An instance's status changed (``on_status_change``): ``None -> pending`` when it
    starts, then ``running``, ``paused`` and back, and one of ``completed``, ``failed``,
    ``cancelled``, ``terminated`` at the end (``-> pending`` again when a start with
    ``if_exists="restart_if_failed"`` begins its next run)."""

    instance_id: str
    workflow: str
    version: str
    old_status: str | None  # None for the first event of an instance
    new_status: str
    at: datetime  # when the change was recorded (UTC)
    # "ErrorType: message" when failed, "cancelled: reason" / "terminated: reason"
    error: str | None


# Hooks may return anything; an awaitable they return is awaited.
ErrorHook = Callable[[StepErrorEvent], object]
StatusHook = Callable[[StatusChangeEvent], object]
