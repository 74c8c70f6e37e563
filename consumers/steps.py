"""The step executor: runs step bodies (async on the loop, sync in a thread pool) with
their per-attempt timeout, and turns whatever happened into a ``StepOutcome``."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.codec import PayloadCodec, check_size, encode_safely
from engine.context import current_attempt
from engine.errors import NonRetryableError, StepstreamError
from engine.runtime import StepLaunch, StepOutcome

log = logging.getLogger("stepstream.steps")


class StepExecutor:
    def __init__(self, codec: PayloadCodec, *, max_payload_bytes: int, threads: int = 32) -> None:
        self._codec = codec
        self._limit = max_payload_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="stepstream-step")
        self._tasks: set[asyncio.Task[None]] = set()

    def launch(self, launch: StepLaunch, deliver: Callable[[StepOutcome], None]) -> None:
        task = asyncio.get_running_loop().create_task(self._run(launch, deliver))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, launch: StepLaunch, deliver: Callable[[StepOutcome], None]) -> None:
        deliver(await self.run(launch))

    async def run(self, launch: StepLaunch) -> StepOutcome:
        try:
            value = await asyncio.wait_for(self._call(launch), launch.timeout)
        except NonRetryableError as exc:
            return self._failed(launch, exc, retryable=False)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the executor itself is being stopped
            # The body raised CancelledError of its own (an inner task it awaited was
            # cancelled): a failed attempt like any other, or it would never report.
            return self._failed(launch, exc, retryable=True)
        except TimeoutError:
            return StepOutcome(
                launch.instance_id,
                launch.key,
                launch.attempt,
                error_type="StepTimeout",
                error_message=f"attempt {launch.attempt} ran longer than {launch.timeout} s",
            )
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

    async def _call(self, launch: StepLaunch) -> Any:
        fn, args, kwargs, attempt = launch.fn, launch.args, launch.kwargs, launch.attempt
        if inspect.iscoroutinefunction(fn):
            current_attempt.set(attempt)
            return await fn(*args, **kwargs)

        def body() -> Any:
            current_attempt.set(attempt)
            return fn(*args, **kwargs)

        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._pool, contextvars.copy_context().run, body)
        if inspect.isawaitable(result):
            return await result
        return result

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
        self._pool.shutdown(wait=False, cancel_futures=True)
