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

from consumers.step_threads import StepThreads
from engine.attempts import AttemptFlag, current_flag
from engine.codec import PayloadCodec, check_size, encode_safely
from engine.context import current_attempt
from engine.errors import NonRetryableError, StepstreamError
from engine.runtime import StepLaunch, StepOutcome

log = logging.getLogger("stepstream.steps")

# How long a cancelled async body may take to end (its ``finally`` blocks, or a body
# that swallows the cancellation) before its outcome is reported without it.
DEFAULT_CANCEL_GRACE_S = 1.0

_TIMEOUT = "timeout"
_CANCELLED = "cancelled"
_SHUTDOWN = "shutdown"

AttemptId = tuple[str, str, int]  # (instance_id, key, attempt)


class _Attempt:
    """One running attempt: its flag, its body task, and why it was given up ("" if not)."""

    __slots__ = ("body", "flag", "launch", "reason", "woken")

    def __init__(self, launch: StepLaunch) -> None:
        self.launch = launch
        self.flag = AttemptFlag()
        self.reason = ""
        self.body: asyncio.Task[Any] | None = None
        # Done when the attempt is given up: its waiter wakes even if the body does not.
        self.woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def label(self) -> str:
        launch = self.launch
        return f"instance={launch.instance_id} step={launch.key} attempt={launch.attempt}"

    def give_up(self, reason: str) -> bool:
        if self.reason or (self.body is not None and self.body.done()):
            return False  # given up already, or too late: its outcome stands
        self.reason = reason
        self.flag.set()
        if not self.woken.done():
            self.woken.set_result(None)
        if self.body is not None:
            self.body.cancel()
        return True


class StepExecutor:
    def __init__(
        self,
        codec: PayloadCodec,
        *,
        max_payload_bytes: int,
        threads: int = 32,
        max_threads: int | None = None,
        cancel_grace_s: float = DEFAULT_CANCEL_GRACE_S,
    ) -> None:
        """``threads`` sync bodies can always start at once; threads kept by bodies
        that overran their attempt come on top, up to ``max_threads`` in all
        (default: four times ``threads``)."""
        self._codec = codec
        self._limit = max_payload_bytes
        self._threads = StepThreads(
            threads, max_threads=max_threads if max_threads is not None else 4 * threads
        )
        self._grace = cancel_grace_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: dict[AttemptId, _Attempt] = {}
        # Async bodies still running after their attempt was given up and the grace.
        self._stragglers: set[asyncio.Task[Any]] = set()

    @property
    def threads(self) -> StepThreads:
        return self._threads

    def launch(self, launch: StepLaunch, deliver: Callable[[StepOutcome], None]) -> None:
        attempt = self._register(launch)  # now, so that ``cancel`` finds it at once
        task = asyncio.get_running_loop().create_task(self._run(attempt, deliver))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel(self, instance_id: str, key: str, attempt: int) -> bool:
        """Give up a running attempt: an async body is cancelled, a sync body flagged
        (``attempt_cancelled()``). Its outcome is a failed attempt with error type
        ``AttemptCancelled``, not retryable; what that means is the caller's to decide.
        False when the attempt is not running here (its outcome is already on its way,
        or it was never launched on this executor). Call on the executor's loop."""
        running = self._running.get((instance_id, key, attempt))
        return running is not None and running.give_up(_CANCELLED)

    async def _run(self, attempt: _Attempt, deliver: Callable[[StepOutcome], None]) -> None:
        try:
            outcome = await self._attempt(attempt)
        finally:
            self._forget(attempt)
        deliver(outcome)

    async def run(self, launch: StepLaunch) -> StepOutcome:
        attempt = self._register(launch)
        try:
            return await self._attempt(attempt)
        finally:
            self._forget(attempt)

    def _register(self, launch: StepLaunch) -> _Attempt:
        attempt = _Attempt(launch)
        self._running[(launch.instance_id, launch.key, launch.attempt)] = attempt
        return attempt

    def _forget(self, attempt: _Attempt) -> None:
        launch = attempt.launch
        attempt_id = (launch.instance_id, launch.key, launch.attempt)
        if self._running.get(attempt_id) is attempt:
            del self._running[attempt_id]

    async def _attempt(self, attempt: _Attempt) -> StepOutcome:
        launch = attempt.launch
        if attempt.reason:  # cancelled before it started
            return self._given_up(attempt)
        context = contextvars.copy_context()
        context.run(_enter_body, launch.attempt, attempt.flag)
        loop = asyncio.get_running_loop()
        body = loop.create_task(self._call(attempt), context=context)
        attempt.body = body
        woken = attempt.woken
        # One future to wait on (cheaper than asyncio.wait on two): done when the body
        # is, or when the attempt is given up (its timeout, a cancel).
        body.add_done_callback(functools.partial(_wake, woken))
        deadline = (
            None
            if launch.timeout is None
            else loop.call_later(launch.timeout, attempt.give_up, _TIMEOUT)
        )
        try:
            await woken
            if deadline is not None:
                deadline.cancel()
            attempt.give_up(_TIMEOUT)  # no-op when the body is done or was cancelled
            if not body.done():
                await asyncio.wait({body}, timeout=self._grace)
        except asyncio.CancelledError:
            attempt.give_up(_SHUTDOWN)  # the executor itself is being stopped
            raise
        if attempt.reason:
            self._settle_late(attempt, body)
            return self._given_up(attempt)
        try:
            value = body.result()
        except NonRetryableError as exc:
            return self._failed(launch, exc, retryable=False)
        except asyncio.CancelledError as exc:
            # The body raised CancelledError of its own (an inner task it awaited was
            # cancelled): a failed attempt like any other, or it would never report.
            cause = exc.__context__ if isinstance(exc.__context__, asyncio.CancelledError) else exc
            return self._failed(launch, cause, retryable=True)
        except Exception as exc:
            return self._failed(launch, exc, retryable=True)
        try:
            payload = check_size(
                encode_safely(self._codec, value),
                self._limit,
                what=f"result of step {launch.key!r}",
            )
        except StepstreamError as exc:
            # Retrying a body that returns an unencodable value would return it again.
            return self._failed(launch, exc, retryable=False)
        return StepOutcome(launch.instance_id, launch.key, launch.attempt, result=payload)

    async def _call(self, attempt: _Attempt) -> Any:
        fn, args, kwargs = attempt.launch.fn, attempt.launch.args, attempt.launch.kwargs
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        result = await self._in_thread(attempt)
        if inspect.isawaitable(result):
            return await result
        return result

    async def _in_thread(self, attempt: _Attempt) -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:  # on the step thread
            try:
                loop.call_soon_threadsafe(_settle, done, value, error)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for this result any more

        launch = attempt.launch
        context = contextvars.copy_context()  # the body's: attempt number and flag
        job = self._threads.submit(
            lambda: context.run(launch.fn, *launch.args, **launch.kwargs),
            settle,
            label=attempt.label,
        )
        try:
            return await done
        except asyncio.CancelledError:
            if self._threads.give_up(job):
                threads = self._threads
                log.warning(
                    "sync step body still running after its attempt was given up "
                    "%s reason=%s: it keeps its thread until it returns (threads held=%d, "
                    "max=%d); it should return when stepstream.attempt_cancelled() is True",
                    attempt.label,
                    attempt.reason or "cancelled",
                    threads.held,
                    threads.max_threads,
                )
                if threads.at_cap:
                    log.warning(
                        "step threads at their cap (%d): new sync step bodies wait for a "
                        "thread until an overrunning one returns",
                        threads.max_threads,
                    )
            raise

    def _settle_late(self, attempt: _Attempt, body: asyncio.Task[Any]) -> None:
        if body.done():
            if not body.cancelled():
                body.exception()  # retrieved: its result is discarded
            return
        log.warning(
            "async step body still running %.1f s after its attempt was given up %s "
            "reason=%s: it ignores cancellation; its outcome is reported without it",
            self._grace,
            attempt.label,
            attempt.reason,
        )
        self._stragglers.add(body)
        body.add_done_callback(self._straggler_done)

    def _straggler_done(self, body: asyncio.Task[Any]) -> None:
        self._stragglers.discard(body)
        if not body.cancelled():
            body.exception()

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
    def _failed(launch: StepLaunch, exc: BaseException, *, retryable: bool) -> StepOutcome:
        log.info(
            "step failed instance=%s step=%s attempt=%d error=%s: %s",
            launch.instance_id,
            launch.key,
            launch.attempt,
            type(exc).__name__,
            exc,
        )
        return StepOutcome(
            launch.instance_id,
            launch.key,
            launch.attempt,
            error_type=type(exc).__name__,
            error_message=str(exc) or repr(exc),
            retryable=retryable,
        )

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for body in self._stragglers:
            body.cancel()
        self._threads.shutdown()


def _wake(woken: asyncio.Future[None], _: object) -> None:
    if not woken.done():
        woken.set_result(None)


def _enter_body(attempt: int, flag: AttemptFlag) -> None:
    current_attempt.set(attempt)
    current_flag.set(flag)


def _settle(done: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if done.done():
        return  # given up meanwhile
    if error is None:
        done.set_result(value)
    else:
        done.set_exception(error)
