"""The threads sync step bodies run on, kept free for fresh attempts.

A thread cannot be stopped from outside, so a sync body that overruns its timeout (or
whose attempt was cancelled) keeps its thread until it returns. A fixed pool would let a
few such bodies starve every later sync step; this pool counts the threads held that
way and grows by as many, so ``threads`` workers stay available for new attempts, up to
a hard cap. A held thread is let go (and the pool shrinks back) when its body returns.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from stepstream.consumers.log_context import LogSubject

log = logging.getLogger("stepstream.steps")

# Called in the worker thread with the body's return value, or the exception it raised.
Settle = Callable[[Any, BaseException | None], None]


class _JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class Job:
    """One call on a step thread. ``about`` names it in logs (instance, step, attempt)."""

    __slots__ = ("_fn", "_settle", "about", "held", "state")

    def __init__(self, fn: Callable[[], Any], settle: Settle, about: LogSubject | None) -> None:
        self._fn = fn
        self._settle = settle
        self.about = about
        self.state = _JobState.QUEUED
        self.held = False  # given up while running: its result is discarded


class StepThreads:
    def __init__(self, threads: int, *, max_threads: int, name: str = "stepstream-step") -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.threads = threads
        self.max_threads = max(max_threads, threads)
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._workers = 0
        self._busy = 0
        self._held = 0
        self._serial = 0
        self._closed = False

    @property
    def held(self) -> int:
        """Threads still running a body whose attempt was given up."""
        return self._held

    @property
    def workers(self) -> int:
        return self._workers

    @property
    def busy(self) -> int:
        """Threads running a body (held ones included)."""
        return self._busy

    @property
    def queued(self) -> int:
        """Bodies waiting for a thread."""
        return len(self._queue)

    def submit(
        self, fn: Callable[[], Any], settle: Settle, *, about: LogSubject | None = None
    ) -> Job:
        job = Job(fn, settle, about)
        with self._cond:
            if self._closed:
                raise RuntimeError("the step executor is shut down")
            self._queue.append(job)
            self._grow()
            self._cond.notify()
        return job

    def give_up(self, job: Job) -> bool:
        """Nobody waits for ``job`` any more. A queued job is dropped; a running one keeps
        its thread, which is counted as held and replaced. True in that last case."""
        with self._cond:
            if job.state is _JobState.QUEUED:
                self._queue.remove(job)
                job.state = _JobState.DONE
                return False
            if job.state is _JobState.DONE or job.held:
                return False
            job.held = True
            self._held += 1
            self._grow()
            return True

    @property
    def at_cap(self) -> bool:
        return self.threads + self._held > self.max_threads

    def shutdown(self) -> None:
        """Queued jobs are dropped; running bodies keep their threads until they return
        (the threads are daemons: a body that never returns does not hold up exit)."""
        with self._cond:
            self._closed = True
            for job in self._queue:
                job.state = _JobState.DONE
            self._queue.clear()
            self._cond.notify_all()

    def _limit(self) -> int:
        return min(self.threads + self._held, self.max_threads)

    def _grow(self) -> None:
        # Called holding the lock: enough idle workers for the queue, within the limit.
        idle = self._workers - self._busy
        while len(self._queue) > idle and self._workers < self._limit():
            self._serial += 1
            thread = threading.Thread(
                target=self._work, name=f"{self._name}-{self._serial}", daemon=True
            )
            self._workers += 1
            idle += 1
            thread.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closed:
                        self._workers -= 1
                        return
                    self._cond.wait()
                job = self._queue.popleft()
                job.state = _JobState.RUNNING
                self._busy += 1
            value: Any = None
            error: BaseException | None = None
            try:
                value = job._fn()
            except BaseException as exc:  # handed to the waiting attempt, as a pool does
                error = exc
            with self._cond:
                job.state = _JobState.DONE
                self._busy -= 1
                held = job.held
                if held:
                    self._held -= 1
                retire = self._workers > self._limit()
                if retire:
                    self._workers -= 1
            if held:
                log.info(
                    "step body returned after its attempt was given up (%s); discarded, its "
                    "thread is free again (held=%d)",
                    "returned" if error is None else type(error).__name__,
                    self._held,
                    extra=job.about.log_fields() if job.about is not None else None,
                )
            else:
                job._settle(value, error)
            del value, error  # a late result must not live on in an idle thread
            if retire:
                return
