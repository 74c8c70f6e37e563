"""``Context``: what workflow code sees. A thin facade over the instance runtime."""

from __future__ import annotations

import random as _random
import uuid as _uuid
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, overload

from engine.retry import RetryPolicy

if TYPE_CHECKING:
    from engine.runtime import InstanceRuntime

T = TypeVar("T")

# Set by the step executor around a step body, so ``ctx.attempt`` works inside it.
current_attempt: ContextVar[int] = ContextVar("stepstream_attempt", default=0)


def _seconds(duration: float | timedelta) -> float:
    seconds = duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
    if seconds < 0:
        raise ValueError(f"duration must not be negative, got {seconds} s")
    return seconds


class Context:
    """Passed to every workflow as its first argument.

    Every method that records something takes a ``name``: the replay key. Names must be
    unique within a workflow run and stable across deploys of the same version.
    """

    __slots__ = ("_rt",)

    def __init__(self, runtime: InstanceRuntime) -> None:
        self._rt = runtime

    @property
    def instance_id(self) -> str:
        return self._rt.state.instance_id

    @property
    def workflow(self) -> str:
        return self._rt.state.workflow

    @property
    def version(self) -> str:
        return self._rt.state.version

    @property
    def attempt(self) -> int:
        """The attempt number (1-based) of the step body currently running; 0 outside."""
        return current_attempt.get()

    @overload
    async def step(
        self,
        name: str,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        retry: RetryPolicy | None = None,
        timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> T: ...

    @overload
    async def step(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        retry: RetryPolicy | None = None,
        timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> T: ...

    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        retry: RetryPolicy | None = None,
        timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` at least once, durably. Its return value is
        recorded and returned again on replay; the body does not run again once it
        succeeded. Raises ``StepFailed`` when the retry policy is used up."""
        limit = None if timeout is None else _seconds(timeout)
        return await self._rt.step_future(name, fn, args, kwargs, retry, limit)

    async def sleep(self, name: str, duration: float | timedelta) -> None:
        """Sleep durably for ``duration`` (seconds or timedelta); survives restarts."""
        await self._rt.sleep_future(name, delay_ms=round(_seconds(duration) * 1000))

    async def sleep_until(self, name: str, when: datetime) -> None:
        if when.tzinfo is None:
            raise ValueError("sleep_until needs a timezone-aware datetime (e.g. UTC)")
        await self._rt.sleep_future(name, wake_at_ms=int(when.timestamp() * 1000))

    async def wait_for_event(
        self,
        name: str,
        *,
        timeout: float | timedelta | None = None,
        key: str | None = None,
    ) -> Any:
        """Wait for an event called ``name`` sent to this instance and return its payload.
        Events sent earlier are buffered and claimed in order of arrival. Raises
        ``EventTimeout`` after ``timeout``. ``key`` is the replay key (default: ``name``);
        give one per wait when waiting for the same event name more than once."""
        limit = None if timeout is None else round(_seconds(timeout) * 1000)
        return await self._rt.wait_future(key or name, name, limit)

    def now(self) -> datetime:
        """The current time, recorded: replay returns the same value."""
        ms: int = self._rt.record_value("now", lambda: self._rt.clock.now_ms())
        return datetime.fromtimestamp(ms / 1000, tz=UTC)

    def uuid(self) -> _uuid.UUID:
        return _uuid.UUID(self._rt.record_value("uuid", lambda: str(_uuid.uuid4())))

    def random(self) -> float:
        """A float in [0, 1), recorded."""
        value: float = self._rt.record_value("random", _random.random)
        return value
