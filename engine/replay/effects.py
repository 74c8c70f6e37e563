"""What an instance runtime takes in besides commands (step outcomes) and what it
decides (records, timers, launches, cancels, commands for other instances), with the
constants its records use and the phases it goes through."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepstream.engine.api.retry import RetryPolicy
from stepstream.engine.replay.state import EntryState
from stepstream.engine.wire.records import (
    Command,
    HistoryRecord,
    Payload,
    TimerRecord,
)

# ``_forget_scope`` walks what the coroutine keeps once it holds at least this much.
FORGET_AT_LEAST = 256

LOST_ATTEMPT = "AttemptLost"
# The purpose of the timer that decides an attempt found lost when an instance recovers.
LOST_PURPOSE = "lost"
PATCH_PREFIX = "~patch/"  # the replay keys of ctx.patched markers
CANCELLED_ATTEMPT = "AttemptCancelled"  # the step executor's error type for a cancel


# The purpose of an entry's timer, by the state that waits for it.
TIMER_PURPOSES = {
    EntryState.BACKOFF: "retry",
    EntryState.SLEEPING: "sleep",
    EntryState.WAITING: "wait",
}


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """How one step attempt ended; produced by the step executor, never by a client."""

    instance_id: str
    key: str
    attempt: int
    result: Payload | None = None
    error_type: str = ""
    error_message: str = ""
    retryable: bool = True
    # The body's exception, formatted (clipped): recorded with the failure (StepFailed
    # v2) and logged once the failure is durable.
    traceback: str | None = None

    @property
    def command_id(self) -> str:
        return f"step:{self.instance_id}/{self.key}/{self.attempt}"


@dataclass(frozen=True, slots=True)
class StepLaunch:
    """A step attempt to run once the records announcing it are durable."""

    instance_id: str
    key: str
    attempt: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout: float | None
    workflow: str = ""  # for log lines about the attempt
    traceparent: str | None = None
    run_start_ms: int = 0  # the run's start: with the instance, names its trace and span
    # When a retry became due (ms): when its backoff ended; 0 for a first attempt, due
    # when the code reached the step (the batch's start, to the processor). Its start
    # less this is the attempt's schedule-to-start latency.
    due_ms: int = 0


@dataclass(slots=True)
class Output:
    """What handling inputs decided, to be committed as one batch."""

    history: list[HistoryRecord] = field(default_factory=list)
    timers: list[TimerRecord] = field(default_factory=list)
    launches: list[StepLaunch] = field(default_factory=list)
    # Running attempts to give up once this is durable: (instance id, key, attempt).
    cancels: list[tuple[str, str, int]] = field(default_factory=list)
    # Commands for other instances (children, parents), published with the records:
    # (the instance that decided it, the command).
    commands: list[tuple[str, Command]] = field(default_factory=list)
    # Answers to messages made durable by the commit (``settled_key`` of the instance and
    # message id -> answer: a message id is an event id, unique on its instance only),
    # for the clients waiting in request(); filled when the state is written.
    replies: dict[str, Payload] = field(default_factory=dict)


@dataclass(slots=True)
class StepIntent:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    policy: RetryPolicy
    timeout: float | None
    ephemeral: bool = False
    # Each attempt runs in a queue's slot: the code starts the next attempt once the
    # queue admits it (``engine.replay.admission``), never the retry's timer.
    queued: bool = False


class Phase(enum.Enum):
    """What the runtime is doing beyond handling an input: one at a time."""

    IDLE = "idle"
    # A drive that may start retries whose backoff is over: on a resume (their timers
    # fired while paused) and on a retry's own timer. Otherwise a replay leaves overdue
    # timers to fire through the command log, after what is already there.
    RETRIES_DUE = "retries_due"
    # recover() drives: an attempt lost with the previous owner is then not decided at
    # once but on a timer that fires now, through the command log, so commands already
    # there (a cancel sent while no worker ran) apply first.
    RECOVERING = "recovering"
    # close() unwinds the coroutine: ctx calls made meanwhile raise Evicted.
    CLOSING = "closing"
