"""The step executor: runs step bodies (async on the loop, sync on step threads) with
their per-attempt timeout, gives attempts up (timeout, ``cancel``), and turns whatever
happened into a ``StepOutcome``.

A given-up async body is cancelled. A given-up sync body cannot be stopped: its flag is
set (``attempt_cancelled()`` turns True), its late result is discarded, and the thread
it keeps is replaced so that fresh attempts never wait for overrunning ones.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from stepstream.consumers import log_context
from stepstream.consumers.log_context import TRACE_OF
from stepstream.consumers.step_threads import StepThreads
from stepstream.engine.api.attempts import AttemptFlag, current_flag
from stepstream.engine.api.outbox import Outbox
from stepstream.engine.errors import InvalidWorkflowCall, NonRetryableError, StepstreamError
from stepstream.engine.replay.effects import StepLaunch, StepOutcome
from stepstream.engine.wire.codec import (
    PayloadCodec,
    check_size,
    encode_safely,
    error_message,
    format_traceback,
)

log = logging.getLogger("stepstream.steps")

# How long a cancelled async body may take to end (its ``finally`` blocks, or a body
# that swallows the cancellation) before its outcome is reported without it.
DEFAULT_CANCEL_GRACE_S = 1.0

_TIMEOUT = "timeout"
_CANCELLED = "cancelled"
_SHUTDOWN = "shutdown"

AttemptId = tuple[str, str, int]  # (instance_id, key, attempt)


class _Attempt:
    """One running attempt: its flag, its task, why it was given up ("" if not), and
    whether its outcome went out (exactly once: when the task ends, or when the
    grace after giving it up passes, whichever comes first)."""

    __slots__ = (
        "deadline",
        "deliver",
        "delivered",
        "flag",
        "launch",
        "partition",
        "reason",
        "subject",
        "task",
    )

    def __init__(
        self,
        launch: StepLaunch,
        deliver: Callable[[StepOutcome], None],
        partition: int,
        outbox: Outbox | None,
    ) -> None:
        self.launch = launch
        self.partition = partition
        self.deliver = deliver
        self.flag = AttemptFlag(launch.attempt, outbox)
        self.reason = ""
        self.delivered = False
        self.task: asyncio.Task[Any] | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.subject = _AttemptSubject(launch, partition)

    def log_fields(self) -> dict[str, Any]:
        """What a line about this attempt says about it."""
        return self.subject.log_fields()


class _AttemptSubject:
    """A step body's log subject (``log_context.LogSubject``). Not the ``_Attempt``
    itself: that holds the task, whose context holds the subject, and the cycle would
    keep every finished step's task and coroutine alive until a garbage collection."""

    __slots__ = ("launch", "partition")

    def __init__(self, launch: StepLaunch, partition: int) -> None:
        self.launch = launch
        self.partition = partition

    def log_fields(self) -> dict[str, Any]:
        launch = self.launch
        return {
            "instance_id": launch.instance_id,
            "workflow": launch.workflow,
            "step": launch.key,
            "attempt": launch.attempt,
            "partition": self.partition,
            TRACE_OF: (launch.instance_id, launch.run_start_ms, launch.traceparent),
        }


class StepExecutor:
    def __init__(
        self,
        codec: PayloadCodec,
        *,
        max_payload_bytes: int,
        threads: int = 32,
        max_threads: int | None = None,
        cancel_grace_s: float = DEFAULT_CANCEL_GRACE_S,
        outbox: Outbox | None = None,
    ) -> None:
        """``threads`` sync bodies can always start at once; threads kept by bodies
        that overran their attempt come on top, up to ``max_threads`` in all
        (default: four times ``threads``). ``outbox``: what ``ctx.publish`` bodies
        produce with (None: they fail, saying how to configure one)."""
        self._codec = codec
        self._outbox = outbox
        self._limit = max_payload_bytes
        self._threads = StepThreads(
            threads, max_threads=max_threads if max_threads is not None else 4 * threads
        )
        self._grace = cancel_grace_s
        self._running: dict[AttemptId, _Attempt] = {}
        # Async bodies still running after their attempt was given up and the grace.
        self._stragglers: set[asyncio.Task[Any]] = set()
        self._closing = False

    @property
    def threads(self) -> StepThreads:
        return self._threads

    def running(self) -> list[AttemptId]:
        """(instance, step key, attempt) of each attempt launched whose outcome has not
        been delivered yet."""
        return list(self._running)

    def launch(
        self, launch: StepLaunch, deliver: Callable[[StepOutcome], None], partition: int = -1
    ) -> None:
        """Start an attempt; ``deliver`` gets its outcome once, on the loop.

        One task per attempt, whose coroutine is the body itself (an async body) or
        the hand-over to a step thread (a sync one); its done callback turns how it
        ended into the outcome. Steps are the engine's hot path: no second task, no
        future to wake, nothing scheduled unless the step has a timeout."""
        attempt = _Attempt(launch, deliver, partition, self._outbox)
        attempt_id = (launch.instance_id, launch.key, launch.attempt)
        self._running[attempt_id] = attempt  # now, so that ``cancel`` finds it at once
        fn = launch.fn
        context = contextvars.copy_context()
        context.run(_enter, attempt.flag, attempt.subject)
        if inspect.iscoroutinefunction(fn):
            try:
                body = fn(*launch.args, **launch.kwargs)
            except Exception as exc:  # a bad call (arguments) fails like the body would
                body = _raise(exc)
        else:
            body = self._sync_body(attempt, context)
        loop = asyncio.get_running_loop()
        task = loop.create_task(body, context=context)
        attempt.task = task
        task.add_done_callback(functools.partial(self._settled, attempt))
        if launch.timeout is not None:
            attempt.deadline = loop.call_later(launch.timeout, self._give_up, attempt, _TIMEOUT)

    async def run(self, launch: StepLaunch) -> StepOutcome:
        """Run one attempt and return its outcome (``launch`` awaited)."""
        outcome: asyncio.Future[StepOutcome] = asyncio.get_running_loop().create_future()
        self.launch(launch, functools.partial(_settle_outcome, outcome))
        try:
            return await outcome
        except asyncio.CancelledError:
            launched = self._running.get((launch.instance_id, launch.key, launch.attempt))
            if launched is not None:
                self._give_up(launched, _SHUTDOWN)
            raise

    def cancel(self, instance_id: str, key: str, attempt: int) -> bool:
        """Give up a running attempt: an async body is cancelled, a sync body flagged
        (``attempt_cancelled()``). Its outcome is a failed attempt with error type
        ``AttemptCancelled``, not retryable; what that means is the caller's to decide.
        False when the attempt is not running here (its outcome is already on its way,
        or it was never launched on this executor). Call on the executor's loop."""
        running = self._running.get((instance_id, key, attempt))
        return running is not None and self._give_up(running, _CANCELLED)

    def _give_up(self, attempt: _Attempt, reason: str) -> bool:
        task = attempt.task
        if attempt.reason or task is None or task.done():
            return False  # given up already, or too late: its outcome stands
        attempt.reason = reason
        attempt.flag.set()
        if attempt.deadline is not None:
            attempt.deadline.cancel()
        task.cancel()
        if reason != _SHUTDOWN:
            # The body may take its time in ``finally`` or swallow the cancellation:
            # its outcome goes out after the grace whatever it does.
            asyncio.get_running_loop().call_later(self._grace, self._overdue, attempt)
        return True

    def _overdue(self, attempt: _Attempt) -> None:
        task = attempt.task
        if attempt.delivered or task is None or task.done():
            return
        log.warning(
            "async step body still running %.1f s after its attempt was given up (%s): it "
            "ignores cancellation; its outcome is reported without it",
            self._grace,
            attempt.reason,
            extra=attempt.log_fields(),
        )
        self._stragglers.add(task)
        self._deliver(attempt, self._given_up(attempt))

    def _settled(self, attempt: _Attempt, task: asyncio.Task[Any]) -> None:
        self._stragglers.discard(task)
        if attempt.deadline is not None:
            attempt.deadline.cancel()
        if attempt.delivered:  # reported after the grace; whatever it did is discarded
            if not task.cancelled():
                task.exception()
            return
        if attempt.reason:
            if attempt.reason == _SHUTDOWN or self._closing:
                self._forget(attempt)
                return
            if not task.cancelled():
                task.exception()  # retrieved: a given-up attempt's result is discarded
            self._deliver(attempt, self._given_up(attempt))
            return
        if task.cancelled():
            if self._closing:
                self._forget(attempt)
                return
            # The body raised CancelledError of its own (an inner task it awaited was
            # cancelled): a failed attempt like any other, or it would never report.
            try:
                task.result()
            except asyncio.CancelledError as exc:
                cause = (
                    exc.__context__ if isinstance(exc.__context__, asyncio.CancelledError) else exc
                )
                self._deliver(attempt, self._failed(attempt, cause, retryable=True))
            return
        self._deliver(attempt, self._outcome(attempt, task))

    def _deliver(self, attempt: _Attempt, outcome: StepOutcome) -> None:
        attempt.delivered = True
        self._forget(attempt)
        attempt.deliver(outcome)

    def _forget(self, attempt: _Attempt) -> None:
        launch = attempt.launch
        attempt_id = (launch.instance_id, launch.key, launch.attempt)
        if self._running.get(attempt_id) is attempt:
            del self._running[attempt_id]

    def _outcome(self, attempt: _Attempt, task: asyncio.Task[Any]) -> StepOutcome:
        launch = attempt.launch
        error = task.exception()
        if error is not None:
            # A ctx call inside the body is a defect of the code: every attempt would
            # raise it again.
            final = isinstance(error, NonRetryableError | InvalidWorkflowCall)
            return self._failed(attempt, error, retryable=not final)
        try:
            payload = check_size(
                encode_safely(self._codec, task.result()),
                self._limit,
                what=f"result of step {launch.key!r}",
            )
        except StepstreamError as exc:
            # Retrying a body that returns an unencodable value would return it again.
            return self._failed(attempt, exc, retryable=False)
        return StepOutcome(launch.instance_id, launch.key, launch.attempt, result=payload)

    async def _sync_body(self, attempt: _Attempt, context: contextvars.Context) -> Any:
        result = await self._in_thread(attempt, context)
        if inspect.isawaitable(result):
            return await result
        return result

    async def _in_thread(self, attempt: _Attempt, context: contextvars.Context) -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:  # on the step thread
            try:
                loop.call_soon_threadsafe(_settle, done, value, error)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for this result any more

        launch = attempt.launch
        # The thread runs in a copy of the body's context (attempt number and flag):
        # a context cannot be entered by two threads at once.
        thread_context = context.copy()
        job = self._threads.submit(
            lambda: thread_context.run(launch.fn, *launch.args, **launch.kwargs),
            settle,
            about=attempt,
        )
        try:
            return await done
        except asyncio.CancelledError:
            if self._threads.give_up(job):
                threads = self._threads
                log.warning(
                    "sync step body still running after its attempt was given up (%s): it "
                    "keeps its thread until it returns (threads held=%d, max=%d); it should "
                    "return when stepstream.attempt_cancelled() is True",
                    attempt.reason or "cancelled",
                    threads.held,
                    threads.max_threads,
                    extra=attempt.log_fields(),
                )
                if threads.at_cap:
                    log.warning(
                        "step threads at their cap (%d): new sync step bodies wait for a "
                        "thread until an overrunning one returns",
                        threads.max_threads,
                    )
            raise

    def _given_up(self, attempt: _Attempt) -> StepOutcome:
        launch = attempt.launch
        if attempt.reason == _TIMEOUT:
            return StepOutcome(
                launch.instance_id,
                launch.key,
                launch.attempt,
                error_type="StepTimeout",
                error_message=f"attempt {launch.attempt} ran longer than {launch.timeout} s",
            )
        return StepOutcome(
            launch.instance_id,
            launch.key,
            launch.attempt,
            error_type="AttemptCancelled",
            error_message=f"attempt {launch.attempt} of step {launch.key!r} was cancelled",
            retryable=False,
        )

    @staticmethod
    def _failed(attempt: _Attempt, exc: BaseException, *, retryable: bool) -> StepOutcome:
        # Logged once the failure is durable, at the level its outcome deserves
        # (``consumers/failure_log.py``), with this traceback.
        launch = attempt.launch
        return StepOutcome(
            launch.instance_id,
            launch.key,
            launch.attempt,
            error_type=type(exc).__name__,
            error_message=error_message(exc),
            retryable=retryable,
            traceback=format_traceback(exc),
        )

    def shutdown(self) -> None:
        self._closing = True
        for attempt in list(self._running.values()):
            self._give_up(attempt, _SHUTDOWN)  # sync bodies see attempt_cancelled()
        for body in self._stragglers:
            body.cancel()
        self._threads.shutdown()


def _enter(flag: AttemptFlag, subject: _AttemptSubject) -> None:
    """Set what a step body's context holds: its cancel flag and its log subject."""
    current_flag.set(flag)
    log_context.current.set(subject)


async def _raise(exc: Exception) -> Any:
    raise exc


def _settle_outcome(outcome: asyncio.Future[StepOutcome], value: StepOutcome) -> None:
    if not outcome.done():
        outcome.set_result(value)


def _settle(done: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if done.done():
        return  # given up meanwhile
    if error is None:
        done.set_result(value)
    else:
        done.set_exception(error)
