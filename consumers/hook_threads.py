"""The threads sync hooks run on, for one partition's hook runner (``consumers.hooks``).

At most ``threads`` sync hooks run at once. A call that overruns its timeout has failed,
but Python cannot stop a thread: its thread is left to finish on its own and no longer
counts against ``threads``, so one hook stuck for good (a call with no timeout of its
own) holds up no other call. The threads are daemons: a stuck one never keeps a worker
from exiting. Only when ``MAX_LEFT_BEHIND`` calls are stuck at once do new ones wait for
one of them to return, so a hook that always hangs cannot start threads without end."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("stepstream.hooks")

# Calls past their timeout whose threads still run, per partition, before new calls wait.
MAX_LEFT_BEHIND = 32

Outcome = tuple[Any, BaseException | None]


class HookThreads:
    def __init__(self, threads: int, name: str) -> None:
        self._running = asyncio.Semaphore(max(threads, 1))  # calls within their timeout
        self._alive = asyncio.Semaphore(max(threads, 1) + MAX_LEFT_BEHIND)  # all threads
        self._name = name
        self.left_behind = 0  # calls past their timeout whose threads still run

    async def call(self, hook: Callable[[Any], Any], event: Any, timeout: float | None) -> Any:
        """``hook(event)`` on a thread of its own; what it returned, or what it raised
        (``TimeoutError`` past ``timeout``)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Outcome] = loop.create_future()
        await self._alive.acquire()
        alive = self._alive
        context = contextvars.copy_context()

        def run() -> None:
            try:
                outcome: Outcome = (context.run(hook, event), None)
            except BaseException as exc:  # the hook's failure, whatever it raised
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(_settle, done, outcome, alive)
            except RuntimeError:  # the loop closed meanwhile: nobody waits for it
                pass

        started = False
        try:
            async with self._running:
                threading.Thread(target=run, name=self._name, daemon=True).start()
                started = True  # its thread gives the permit back when it ends
                try:
                    result, error = await asyncio.wait_for(asyncio.shield(done), timeout)
                except TimeoutError:
                    self._leave_behind(done, timeout)
                    raise
        finally:
            if not started:  # cancelled before its thread ran (the runner stopping)
                alive.release()
        if error is not None:
            raise error
        return result

    def _leave_behind(self, done: asyncio.Future[Outcome], timeout: float | None) -> None:
        self.left_behind += 1
        done.add_done_callback(self._returned_late)
        log.error(
            "a sync hook is still running %s s after it was called: its call failed, and its "
            "thread is left to finish on its own (a thread cannot be stopped; %d left now). "
            "Give what the hook waits for a timeout shorter than STEPSTREAM_HOOK_TIMEOUT_S",
            timeout,
            self.left_behind,
        )

    def _returned_late(self, _: asyncio.Future[Outcome]) -> None:
        self.left_behind -= 1


def _settle(done: asyncio.Future[Outcome], outcome: Outcome, alive: asyncio.Semaphore) -> None:
    alive.release()
    if not done.done():
        done.set_result(outcome)
