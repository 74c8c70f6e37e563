"""A deterministic event loop for workflow code.

Workflow coroutines run on their own loop that only knows ready callbacks: no clock, no
I/O, no threads. ``run_until_quiet`` runs callbacks until nothing is ready, so after it
returns the workflow is blocked on stepstream futures only, and every intent it made in
this turn is known. ``asyncio.gather``, tasks and futures work as usual; ``asyncio.sleep``
and other timer APIs raise, because a workflow must sleep with ``ctx.sleep``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from contextvars import Context as _CtxVars
from typing import Any, NoReturn

from stepstream.engine.errors import StepstreamError

log = logging.getLogger("stepstream.engine")

ROOT_TASK = "main"
_PRUNE_AT_LEAST = 64


class NondeterministicCall(StepstreamError, RuntimeError):
    """Workflow code used a real-time asyncio API (``asyncio.sleep``, ``loop.time``):
    replay could not reproduce it. Use ``ctx.sleep`` and ``ctx.now``."""


class WorkflowLoop(asyncio.AbstractEventLoop):
    def __init__(self, name: str) -> None:
        self._name = name
        self._ready: deque[asyncio.Handle] = deque()
        self._closed = False
        self._ready_running = False
        self._children: dict[str, int] = {}
        # This loop's tasks (asyncio.all_tasks would walk every task of the process),
        # finished ones dropped whenever the list has doubled since the last time.
        self._tasks: list[asyncio.Task[Any]] = []
        self._prune_at = _PRUNE_AT_LEAST
        # A clock of this run's code: each task created and each name used takes the
        # next tick, so two uses of a name tell whether their tasks were alive together.
        self.ticks = 0
        self._born: dict[str, int] = {}  # task path -> its tick

    # ---- what asyncio's futures and tasks need ----------------------------------------

    def call_soon(  # type: ignore[override]
        self, callback: Callable[..., object], *args: Any, context: _CtxVars | None = None
    ) -> asyncio.Handle:
        handle = asyncio.Handle(callback, args, self, context)
        if not self._closed:
            self._ready.append(handle)
        return handle

    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.Future(loop=self)

    def create_task(  # type: ignore[override]
        self,
        coro: Coroutine[Any, Any, Any],
        *,
        name: str | None = None,
        context: _CtxVars | None = None,
    ) -> asyncio.Task[Any]:
        # Tasks are named by where they were created: the parent's path plus the child's
        # index within it. Code inside one task runs sequentially, so the path is the
        # same on every replay, whatever order concurrent branches happen to run in.
        parent = asyncio.current_task(self) if self._ready_running else None
        parent_path = parent.get_name() if parent is not None else ""
        index = self._children.get(parent_path, 0)
        self._children[parent_path] = index + 1
        path = f"{parent_path}.{index}" if parent_path else ROOT_TASK if index == 0 else str(index)
        self._born[path] = self.ticks
        self.ticks += 1
        return self._track(asyncio.Task(coro, loop=self, name=path, context=context))

    def born(self, task: asyncio.Task[Any]) -> int:
        """The tick ``task`` was created at (0 if it is not this loop's)."""
        return self._born.get(task.get_name(), 0)

    def _track(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        tasks = self._tasks
        if len(tasks) >= self._prune_at:
            # Not at every task past a fixed count: with thousands running at once (a
            # gather over many steps) each new task would walk them all.
            tasks = self._tasks = [t for t in tasks if not t.done()]
            self._prune_at = max(_PRUNE_AT_LEAST, 2 * len(tasks))
            # Only a live task asks when it was made (``born``): forget the others'.
            born = self._born
            alive = (t.get_name() for t in (*tasks, task))
            self._born = {name: born[name] for name in alive if name in born}
        tasks.append(task)
        return task

    def pending_tasks(self) -> list[asyncio.Task[Any]]:
        """The tasks of this loop that have not finished."""
        return [t for t in self._tasks if not t.done()]

    def create_named_task(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A task with a path of the caller's choosing, unique and stable across replays
        (a loop iteration's), that does not shift the indexes of the parent's tasks."""
        self._born[name] = self.ticks
        self.ticks += 1
        return self._track(asyncio.Task(coro, loop=self, name=name))

    def forget_tasks(self, gone: Callable[[str], bool]) -> None:
        """Forget the child counts of finished tasks whose paths are ``gone``."""
        for path in [p for p in self._children if gone(p)]:
            del self._children[path]
        for path in [p for p in self._born if gone(p)]:
            del self._born[path]

    @staticmethod
    def task_path() -> str:
        """The deterministic path of the workflow task running now."""
        task = asyncio.current_task()
        return task.get_name() if task is not None else ROOT_TASK

    def get_debug(self) -> bool:
        return False

    def is_closed(self) -> bool:
        return self._closed

    def is_running(self) -> bool:
        return not self._closed

    def get_task_factory(self) -> None:
        return None

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        if self._closed:
            return  # a discarded workflow's pending tasks are expected to be destroyed
        log.warning("workflow %s: %s", self._name, context.get("message"), exc_info=None)

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        self.call_exception_handler(context)

    # ---- real time is not available to workflow code ---------------------------------

    def _nondeterministic(self, what: str) -> NoReturn:
        raise NondeterministicCall(
            f"workflow {self._name} called {what}; workflow code must be deterministic: "
            "use ctx.sleep / ctx.sleep_until to wait and ctx.step for I/O"
        )

    def time(self) -> float:
        self._nondeterministic("loop.time()")

    def call_later(self, *args: Any, **kwargs: Any) -> NoReturn:  # type: ignore[override]
        self._nondeterministic("asyncio.sleep or loop.call_later")

    def call_at(self, *args: Any, **kwargs: Any) -> NoReturn:  # type: ignore[override]
        self._nondeterministic("loop.call_at")

    def run_in_executor(self, *args: Any, **kwargs: Any) -> NoReturn:  # type: ignore[override]
        self._nondeterministic("run_in_executor (use ctx.step)")

    # ---- driving --------------------------------------------------------------------

    def run_until_quiet(self) -> None:
        outer = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(self)
        self._ready_running = True
        try:
            ready = self._ready
            while ready:
                handle = ready.popleft()
                if not handle._cancelled:
                    handle._run()
        finally:
            self._ready_running = False
            asyncio.events._set_running_loop(outer)

    def close(self) -> None:
        """Stop running callbacks and let go of the tasks. A task points back at its loop,
        and a cancelled one at its CancelledError, whose traceback holds the finished
        frames and their locals: left as they are, each discarded instance would be a
        heap of cyclic garbage that only the collector frees (about 30 objects for an
        evicted sleeper), and collections are what stops the engine's loop."""
        self._closed = True
        self._ready.clear()
        for task in self._tasks:
            if task.done():
                _release(task)
        self._tasks = []
        self._children.clear()


def _release(task: asyncio.Task[Any]) -> None:
    """Drop the tracebacks a finished task's exception holds (and those of the errors
    it was raised from): a traceback keeps the finished frames and their locals alive,
    and they point back at the task. A cancelled task hands its CancelledError over when
    asked for its result; the name bound here goes at the end of the ``except`` block."""
    if task.cancelled():
        try:
            task.result()
        except asyncio.CancelledError as cancelled:
            _drop_tracebacks(cancelled)
        return
    error = task.exception()
    if error is not None:
        _drop_tracebacks(error)


def _drop_tracebacks(error: BaseException) -> None:
    # Not frame.clear(): on a suspended generator's frame that would close it, running
    # its ``finally`` outside the workflow's loop.
    pending: list[BaseException | None] = [error]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += (current.__context__, current.__cause__)
