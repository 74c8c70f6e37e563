"""The step executor: per-attempt timeouts, ``cancel``, ``attempt_cancelled()``, and step
threads that stay free for fresh attempts however many bodies overrun theirs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

import stepstream
from stepstream.consumers.steps import StepExecutor
from stepstream.engine.api.attempts import attempt_number
from stepstream.engine.replay.runtime import StepLaunch, StepOutcome
from stepstream.engine.wire.codec import JsonCodec

# Long enough that a body waiting this long is clearly stuck; tests release them first.
STUCK_S = 60.0
# The most a condition may take to come true: only a broken executor needs this long (a
# loaded machine is slower, never this slow).
WAIT_S = 30.0


def _launch(
    fn: Callable[..., Any],
    *args: Any,
    timeout: float | None = None,
    key: str = "s",
    instance: str = "i-1",
    attempt: int = 1,
) -> StepLaunch:
    return StepLaunch(instance, key, attempt, fn, args, {}, timeout)


@pytest.fixture
async def executor() -> AsyncIterator[StepExecutor]:
    ex = StepExecutor(JsonCodec(), max_payload_bytes=1 << 20)
    yield ex
    ex.shutdown()


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at the end of the test, so bodies stuck on it return and their threads end."""
    event = threading.Event()
    yield event
    event.set()


async def _until(check: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def _value(outcome: StepOutcome) -> Any:
    assert outcome.result is not None, outcome
    return JsonCodec().decode(outcome.result)


def test_attempt_cancelled_is_false_outside_a_step_body() -> None:
    assert stepstream.attempt_cancelled() is False


async def test_sync_and_async_bodies_see_their_attempt_and_a_clear_flag(
    executor: StepExecutor,
) -> None:
    def sync_body() -> list[Any]:
        return [attempt_number(), stepstream.attempt_cancelled()]

    async def async_body() -> list[Any]:
        return [attempt_number(), stepstream.attempt_cancelled()]

    assert _value(await executor.run(_launch(sync_body, attempt=3, timeout=5))) == [3, False]
    assert _value(await executor.run(_launch(async_body, attempt=2, timeout=5))) == [2, False]
    assert stepstream.attempt_cancelled() is False  # nothing leaks into the caller


async def test_a_sync_body_sees_attempt_cancelled_once_its_timeout_passed(
    executor: StepExecutor,
) -> None:
    seen: list[str] = []
    returned = threading.Event()

    def polite() -> str:
        deadline = time.monotonic() + STUCK_S
        while time.monotonic() < deadline:
            if stepstream.attempt_cancelled():
                seen.append("cancelled")
                returned.set()
                return "stopped early"
            time.sleep(0.005)
        return "ran to the end"

    started = time.monotonic()
    outcome = await executor.run(_launch(polite, timeout=0.1, key="poll"))
    assert time.monotonic() - started < 2
    assert (outcome.error_type, outcome.retryable) == ("StepTimeout", True)
    assert outcome.error_message == "attempt 1 ran longer than 0.1 s"
    assert await asyncio.to_thread(returned.wait, 5)
    assert seen == ["cancelled"]
    await _until(lambda: executor.threads.held == 0)  # its thread is let go


async def test_an_async_body_is_cancelled_at_its_timeout(executor: StepExecutor) -> None:
    seen: list[str] = []

    async def slow() -> str:
        try:
            await asyncio.sleep(STUCK_S)
        except asyncio.CancelledError:
            seen.append(f"cancelled, flag={stepstream.attempt_cancelled()}")
            raise
        return "late"

    outcome = await executor.run(_launch(slow, timeout=0.05))
    assert (outcome.error_type, outcome.retryable) == ("StepTimeout", True)
    assert seen == ["cancelled, flag=True"]


async def test_cancel_stops_an_async_body_and_reports_attempt_cancelled(
    executor: StepExecutor,
) -> None:
    seen: list[str] = []
    started = asyncio.Event()
    delivered: asyncio.Future[StepOutcome] = asyncio.get_running_loop().create_future()

    async def body() -> str:
        started.set()
        try:
            await asyncio.sleep(STUCK_S)
        finally:
            seen.append("cleaned up")
        return "late"

    executor.launch(_launch(body, timeout=STUCK_S, key="b", attempt=2), delivered.set_result)
    await started.wait()
    assert executor.cancel("i-1", "b", 1) is False  # another attempt: not running
    assert executor.cancel("i-1", "b", 2) is True
    outcome = await asyncio.wait_for(delivered, 5)
    assert (outcome.key, outcome.attempt) == ("b", 2)
    assert (outcome.error_type, outcome.retryable) == ("AttemptCancelled", False)
    assert outcome.error_message == "attempt 2 of step 'b' was cancelled"
    assert seen == ["cleaned up"]
    assert executor.cancel("i-1", "b", 2) is False  # finished: nothing left to cancel


async def test_cancel_flags_a_sync_body_and_reports_at_once(
    executor: StepExecutor, release: threading.Event
) -> None:
    running = threading.Event()
    flags: list[bool] = []
    delivered: asyncio.Future[StepOutcome] = asyncio.get_running_loop().create_future()

    def body() -> str:
        running.set()
        release.wait(STUCK_S)
        flags.append(stepstream.attempt_cancelled())
        return "late"

    executor.launch(_launch(body, key="sync"), delivered.set_result)
    assert await asyncio.to_thread(running.wait, 5)
    assert executor.cancel("i-1", "sync", 1) is True
    outcome = await asyncio.wait_for(delivered, 2)  # without waiting for the body
    assert (outcome.error_type, outcome.retryable) == ("AttemptCancelled", False)
    assert executor.threads.held == 1
    release.set()
    await _until(lambda: executor.threads.held == 0)
    assert flags == [True]


async def test_cancel_right_after_launch_never_runs_the_body(executor: StepExecutor) -> None:
    ran: list[str] = []
    delivered: asyncio.Future[StepOutcome] = asyncio.get_running_loop().create_future()
    executor.launch(_launch(lambda: ran.append("ran"), key="never"), delivered.set_result)
    assert executor.cancel("i-1", "never", 1) is True
    outcome = await asyncio.wait_for(delivered, 2)
    assert outcome.error_type == "AttemptCancelled"
    await asyncio.sleep(0.05)
    assert ran == []


async def test_a_cancel_that_comes_after_the_body_returned_keeps_its_result(
    executor: StepExecutor,
) -> None:
    delivered: asyncio.Future[StepOutcome] = asyncio.get_running_loop().create_future()

    async def quick() -> int:
        return 7

    executor.launch(_launch(quick, key="q"), delivered.set_result)
    for _ in range(3):
        await asyncio.sleep(0)  # the body ran; the attempt has not reported yet
    executor.cancel("i-1", "q", 1)
    assert _value(await asyncio.wait_for(delivered, 2)) == 7


async def test_a_late_sync_result_is_discarded_and_its_thread_let_go(
    executor: StepExecutor, release: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    def body() -> str:
        release.wait(STUCK_S)
        return "late"

    caplog.set_level(logging.INFO, logger="stepstream.steps")
    outcome = await executor.run(_launch(body, timeout=0.05, instance="late-1", key="charge"))
    assert outcome.error_type == "StepTimeout" and outcome.result is None
    assert executor.threads.held == 1
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    fields = warning.__dict__  # the fields of its log line
    assert (fields["instance_id"], fields["step"], fields["attempt"]) == ("late-1", "charge", 1)
    assert "(timeout)" in warning.getMessage()
    assert "attempt_cancelled()" in warning.getMessage()
    release.set()
    await _until(lambda: executor.threads.held == 0)
    assert any("returned after its attempt was given up" in r.getMessage() for r in caplog.records)


class Gauge:
    """Counts the step bodies running at once, and the most there ever were."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.started: list[str] = []

    @contextlib.contextmanager
    def running(self, name: str) -> Iterator[None]:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.started.append(name)
        try:
            yield
        finally:
            with self._lock:
                self.now -= 1


async def _overrun(
    executor: StepExecutor, gauge: Gauge, body: Callable[[str], Any], keys: list[str]
) -> None:
    """Launch ``body`` under each key, wait until every one that got a thread is running,
    then give all of them up: each running one keeps its thread (held), the others are
    dropped from the queue unstarted. No timeout decides which is which."""
    delivered: dict[str, asyncio.Future[StepOutcome]] = {}
    loop = asyncio.get_running_loop()
    for key in keys:
        delivered[key] = loop.create_future()
        executor.launch(_launch(body, key, key=key), delivered[key].set_result)
    threads = executor.threads

    def settled() -> bool:  # no body between the queue and its first line, no idle thread
        started = len(set(keys) & set(gauge.started))
        idle = threads.workers - threads.busy
        return started + threads.queued == len(keys) and (idle == 0 or threads.queued == 0)

    await _until(settled)
    started = set(gauge.started)
    # Queued ones first: giving up a running one grows the pool, which would start them.
    for key in sorted(keys, key=lambda k: k in started):
        assert executor.cancel("i-1", key, 1)
    for key in keys:
        outcome = await asyncio.wait_for(delivered[key], WAIT_S)
        assert outcome.error_type == "AttemptCancelled", outcome


async def test_overrunning_sync_bodies_never_starve_fresh_attempts(
    executor: StepExecutor, release: threading.Event
) -> None:
    threads = executor.threads
    assert threads.threads == 32
    gauge = Gauge()

    def stuck(key: str) -> str:
        with gauge.running(key):
            release.wait(STUCK_S)
        return key

    await _overrun(executor, gauge, stuck, [f"stuck-{n}" for n in range(40)])
    # The 32 that got a thread keep it; the 8 queued behind them never started.
    assert threads.held == len(gauge.started) == 32

    # A fresh attempt still gets a thread (starved, it would wait here for ever)...
    quick = await asyncio.wait_for(executor.run(_launch(lambda: "quick", key="quick")), WAIT_S)
    assert _value(quick) == "quick"
    # ...and so do many at once: all 32 run together (32 free threads).
    gate = threading.Barrier(32, timeout=WAIT_S)
    many = await asyncio.gather(*(executor.run(_launch(gate.wait, key=f"m{n}")) for n in range(32)))
    assert all(o.result is not None for o in many), [o.error_message for o in many]

    release.set()
    await _until(lambda: threads.held == 0)
    await _until(lambda: threads.workers <= 32)  # back to its size


async def test_the_thread_cap_holds_and_a_returning_body_frees_a_thread(
    release: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    executor = StepExecutor(JsonCodec(), max_payload_bytes=1 << 20, threads=2, max_threads=3)
    threads = executor.threads
    gauge = Gauge()
    try:
        first_release = threading.Event()

        def stuck(key: str) -> str:
            with gauge.running(key):
                (first_release if key == "a" else release).wait(STUCK_S)
            return key

        await _overrun(executor, gauge, stuck, ["a", "b"])
        assert threads.held == 2
        assert any("at their cap (3)" in r.getMessage() for r in caplog.records)
        # One thread is left under the cap: a quick step runs on it...
        assert (
            _value(await asyncio.wait_for(executor.run(_launch(lambda: 1, key="c")), WAIT_S)) == 1
        )
        # ...and a third overrunning body takes it: three threads busy, the cap.
        await _overrun(executor, gauge, stuck, ["d"])
        assert threads.held == 3

        # Steps launched now wait for a thread: none of them starts, however long one
        # looks, as long as the three bodies keep their threads.
        go = threading.Event()

        def counted(key: str) -> str:
            with gauge.running(key):
                go.wait(STUCK_S)
            return key

        waiting = [
            asyncio.ensure_future(executor.run(_launch(counted, f"e{n}", key=f"e{n}")))
            for n in range(4)
        ]
        await _until(lambda: threads.queued == 4)
        assert (threads.workers, threads.busy, gauge.now) == (3, 3, 3)
        assert not any(name.startswith("e") for name in gauge.started)

        first_release.set()  # one overrunning body returns: its thread serves the queue
        go.set()
        outcomes = await asyncio.wait_for(asyncio.gather(*waiting), WAIT_S)
        assert [_value(o) for o in outcomes] == ["e0", "e1", "e2", "e3"]
        # Never more bodies at once than the cap, and the queue went through the one
        # thread that was freed (two stay held).
        assert gauge.peak == 3
        assert threads.held == 2 and threads.workers <= 3
    finally:
        release.set()
        executor.shutdown()


async def test_an_async_body_that_ignores_cancellation_is_reported_after_the_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    executor = StepExecutor(JsonCodec(), max_payload_bytes=1 << 20, cancel_grace_s=0.1)
    stop = asyncio.Event()

    async def stubborn() -> str:
        while not stop.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue
        return "finally"

    try:
        started = time.monotonic()
        outcome = await executor.run(_launch(stubborn, timeout=0.05, key="stubborn"))
        assert outcome.error_type == "StepTimeout"
        assert time.monotonic() - started < 1.0
        assert any("ignores cancellation" in r.getMessage() for r in caplog.records)
    finally:
        stop.set()
        await asyncio.sleep(0.05)
        executor.shutdown()


async def test_cancel_reports_an_async_body_that_ignores_it_after_the_grace() -> None:
    executor = StepExecutor(JsonCodec(), max_payload_bytes=1 << 20, cancel_grace_s=0.1)
    stop = asyncio.Event()
    delivered: asyncio.Future[StepOutcome] = asyncio.get_running_loop().create_future()

    async def stubborn() -> str:
        while not stop.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue
        return "finally"

    try:
        executor.launch(_launch(stubborn, key="no-timeout"), delivered.set_result)
        await asyncio.sleep(0.05)
        assert executor.cancel("i-1", "no-timeout", 1) is True
        outcome = await asyncio.wait_for(delivered, 2)
        assert outcome.error_type == "AttemptCancelled"
    finally:
        stop.set()
        await asyncio.sleep(0.05)
        executor.shutdown()


async def test_a_body_raising_cancelled_error_of_its_own_is_a_failed_attempt(
    executor: StepExecutor,
) -> None:
    async def body() -> None:
        raise asyncio.CancelledError("inner task cancelled")

    outcome = await executor.run(_launch(body, timeout=5))
    assert (outcome.error_type, outcome.retryable) == ("CancelledError", True)
    assert outcome.error_message == "inner task cancelled"


async def test_a_sync_body_returning_an_awaitable_is_awaited(executor: StepExecutor) -> None:
    async def later() -> str:
        return "awaited"

    assert _value(await executor.run(_launch(lambda: later(), timeout=5))) == "awaited"


async def test_stopping_the_executor_flags_running_sync_bodies(
    release: threading.Event,
) -> None:
    executor = StepExecutor(JsonCodec(), max_payload_bytes=1 << 20)
    running = threading.Event()
    flags: list[bool] = []

    def body() -> None:
        running.set()
        while not stepstream.attempt_cancelled() and not release.is_set():
            time.sleep(0.005)
        flags.append(stepstream.attempt_cancelled())

    executor.launch(_launch(body, key="stop"), lambda outcome: None)
    assert await asyncio.to_thread(running.wait, 5)
    executor.shutdown()
    await _until(lambda: flags == [True])
