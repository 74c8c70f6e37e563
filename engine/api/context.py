"""``Context``: what workflow code sees. A thin facade over the instance runtime, which
it reaches through the small ``WorkflowRuntime`` protocol (``runtime``; no import of
the runtime itself).

Names are replay keys. The nth use of a name within a scope is its own key (``charge``,
``charge#2``, ...), computed when the ``ctx`` method is called, in the calling task, so
the keys of ``asyncio.gather(ctx.step("charge", ...), ctx.step("charge", ...))`` do not
depend on which branch runs first. ``async with ctx.scope("shipping")`` prefixes the
names inside it (``shipping/charge``); ``#`` and ``/`` are therefore reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import random as _random
import uuid as _uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar, overload

from stepstream.engine.api.attempts import attempt_number, refuse_in_step_body
from stepstream.engine.api.branches import Branch, check_branches
from stepstream.engine.api.branches import join as branches_join
from stepstream.engine.api.branches import race as branches_race
from stepstream.engine.api.durations import seconds_of
from stepstream.engine.api.loops import LoopBody, run_loop
from stepstream.engine.api.messages import Messages
from stepstream.engine.api.outbox import (
    NAME_PREFIX,
    PUBLISH_RETRY,
    Published,
    outbox_record,
    publish_body,
    published,
)
from stepstream.engine.api.queues import Queue, queued_step
from stepstream.engine.api.retry import RetryPolicy
from stepstream.engine.api.runtime import WorkflowRuntime
from stepstream.engine.api.saga import SagaFrame, current_saga, hand_over, register, roll_back
from stepstream.engine.api.scopes import current_scope
from stepstream.engine.errors import (
    ChildFailed,
    InvalidWorkflowCall,
    StepFailed,
)
from stepstream.engine.wire.names import whole_in

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepFailure:
    """Why a step run with ``ctx.try_step`` failed.

    ``kind``: "exhausted" (every attempt the retry policy allows failed), "timeout" (the
    last attempt ran past the step's timeout), "non_retryable" (the body raised
    ``NonRetryableError``, returned a value that cannot be recorded, or called a ``ctx``
    method: ``InvalidWorkflowCall``), "cancelled"
    (the attempt was cancelled). A subclass of ``NonRetryableError`` raised by the last
    attempt the policy allows reads "exhausted": its ``error_type`` is its own name."""

    kind: str
    attempts: int
    error_type: str
    message: str


@dataclass(frozen=True, slots=True)
class StepResult(Generic[T]):
    """What ``ctx.try_step`` returns: ``ok`` and ``value``, or the ``failure``."""

    ok: bool
    value: T | None = None
    failure: StepFailure | None = None


async def _awaiting(fut: asyncio.Future[Any]) -> Any:
    return await fut


async def _published(fut: asyncio.Future[Any]) -> Published:
    return published(await fut)


class ChildHandle:
    """A child workflow started with ``ctx.start_child``."""

    __slots__ = ("_key", "_rt", "instance_id")

    def __init__(self, runtime: WorkflowRuntime, key: str, instance_id: str) -> None:
        self._rt = runtime
        self._key = key
        self.instance_id = instance_id

    @property
    def key(self) -> str:
        """The child's replay key in this instance (its scope and repeat count)."""
        return self._key

    async def result(self) -> Any:
        """The child's result once it completed; ``ChildFailed`` if it failed or was
        cancelled. Await it at most once."""
        outcome = await self._rt.child_result(self._key)
        status = outcome.get("status")
        if status == "completed":
            return outcome.get("result")
        error_type = str(outcome.get("error_type", ""))
        error = str(outcome.get("error", ""))
        raise ChildFailed(
            f"child {self.instance_id} ({self._key}) {status}: "
            + (f"{error_type}: {error}" if error_type else error or "no reason"),
            child_id=self.instance_id,
            status=str(status),
            error_type=error_type,
            error=error,
        )


def _seconds(duration: float | timedelta) -> float:
    return seconds_of(duration, "duration")


class Context:
    """Passed to every workflow as its first argument.

    Every method that records something takes a ``name``: the replay key. Names must be
    unique within a workflow run and stable across deploys of the same version.
    """

    __slots__ = ("_rt",)

    def __init__(self, runtime: WorkflowRuntime) -> None:
        self._rt = runtime

    @property
    def instance_id(self) -> str:
        return self._rt.instance_id

    @property
    def workflow(self) -> str:
        return self._rt.workflow

    @property
    def version(self) -> str:
        return self._rt.version

    @property
    def messages(self) -> Messages:
        """Named message queues of this instance, and sending to other instances."""
        refuse_in_step_body("ctx.messages")
        return Messages(self._rt, self._rt.codec)

    @property
    def attempt(self) -> int:
        """The attempt number (1-based) of the step body currently running; 0 outside."""
        return attempt_number()

    @overload
    def step(
        self,
        name: str,
        fn: Callable[..., Coroutine[Any, Any, T]],
        *args: Any,
        retry: RetryPolicy | None = None,
        timeout: float | timedelta | None = None,
        compensate: Callable[[T], Any] | None = None,
        ephemeral: bool = False,
        queue: Queue | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, T]: ...

    @overload
    def step(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        retry: RetryPolicy | None = None,
        timeout: float | timedelta | None = None,
        compensate: Callable[[T], Any] | None = None,
        ephemeral: bool = False,
        queue: Queue | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, T]: ...

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        retry: RetryPolicy | None = None,
        timeout: float | timedelta | None = None,
        compensate: Callable[[Any], Any] | None = None,
        ephemeral: bool = False,
        queue: Queue | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, Any]:
        """Run ``fn(*args, **kwargs)`` at least once, durably. Its return value is
        recorded and returned again on replay; the body does not run again once it
        succeeded. Raises ``StepFailed`` when the retry policy is used up. The step is
        started when this is called; await the result. ``compensate``: inside a
        ``ctx.saga``, what undoes the step (called with its result) on a rollback.
        ``ephemeral``: nothing is recorded before the body runs (one record less, one
        commit less before it starts); its result is recorded when it comes back, and a
        crash before that runs it again. For cheap, idempotent steps.
        ``queue``: the step starts once the ``Queue`` admits it and frees its slot when
        it ends (with the instance's priority and queue key); see docs/queues.md."""
        refuse_in_step_body("ctx.step")
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise InvalidWorkflowCall(
                f"step {name!r}: retry={retry!r} is not a stepstream.RetryPolicy (for three "
                "attempts: retry=RetryPolicy(max_attempts=3))"
            )
        limit = None if timeout is None else _seconds(timeout)
        key = self._rt.key_for(name)
        if compensate is None and queue is None:  # the common case, kept short
            return _awaiting(self._rt.step_future(key, fn, args, kwargs, retry, limit, ephemeral))
        frame = current_saga.get()
        if compensate is not None and frame is None:
            raise InvalidWorkflowCall(
                f"step {key!r} has compensate= but no enclosing ctx.saga(...) block"
            )
        if compensate is not None and not callable(compensate):
            raise InvalidWorkflowCall(
                f"step {key!r}: compensate={compensate!r} is not callable (give the "
                "function that undoes the step; it is called with the step's result)"
            )
        if queue is None:
            fut = self._rt.step_future(key, fn, args, kwargs, retry, limit, ephemeral)
            if compensate is not None and frame is not None:
                register(key, compensate, fut, frame)
            return _awaiting(fut)
        return self._queued_step(
            key, queue, fn, args, kwargs, retry, limit, ephemeral, compensate, frame
        )

    async def _queued_step(
        self,
        key: str,
        queue: Queue,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retry: RetryPolicy | None,
        limit: float | None,
        ephemeral: bool,
        compensate: Callable[[Any], Any] | None,
        frame: SagaFrame | None,
    ) -> Any:
        """``ctx.step(..., queue=)``: each attempt runs in a slot of ``queue``."""
        rt = self._rt
        priority, queue_key = rt.queue_request

        def attempt_after(after: int) -> asyncio.Future[Any]:
            return rt.queued_attempt_future(key, fn, args, kwargs, retry, limit, ephemeral, after)

        run = queued_step(self, queue, key, attempt_after, priority=priority, queue_key=queue_key)
        if compensate is None or frame is None:
            return await run
        outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        register(key, compensate, outcome, frame)
        try:
            value = await run
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                outcome.cancel()
            else:
                outcome.set_exception(exc)
                outcome.exception()  # the caller gets it; a rollback reads it again
            raise
        outcome.set_result(value)
        return value

    async def try_step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        retry: RetryPolicy | None = None,
        timeout: float | timedelta | None = None,
        **kwargs: Any,
    ) -> StepResult[Any]:
        """``ctx.step`` that never raises for a step failure: a ``StepResult`` with
        ``ok`` and ``value``, or ``failure`` (kind, attempts, error type, message)."""
        try:
            value = await self.step(name, fn, *args, retry=retry, timeout=timeout, **kwargs)
        except StepFailed as exc:
            failure = StepFailure(exc.kind, exc.attempts, exc.error_type, exc.error_message)
            return StepResult(ok=False, failure=failure)
        return StepResult(ok=True, value=value)

    def publish(
        self,
        topic: str,
        value: Any,
        key: str | bytes | None = None,
        headers: dict[str, str | bytes] | None = None,
        *,
        name: str | None = None,
    ) -> Coroutine[Any, Any, Published]:
        """Produce a record to the Kafka topic ``topic``, as a durable step: it goes out
        after the transition that reached this call is durable, is retried until the
        broker acknowledged it, and replay returns where it landed without producing
        again. ``value``: bytes as they are, anything else through the payload codec
        (JSON by default); ``key``: str or bytes; ``headers``: str to str or bytes. Every
        copy of the record carries the header ``stepstream-id`` (``<instance id>/<replay
        key>``, ``<instance id>/run<n>/<replay key>`` in a restarted run; the same on
        every retry and replay): a consumer that drops ids it has
        seen gets each publish once. ``name``: the replay key (default
        ``publish:<topic>``, counted like any name when it repeats)."""
        refuse_in_step_body("ctx.publish")
        record = outbox_record(topic, value, key, headers, codec=self._rt.codec)
        step_key = self._rt.key_for(name or f"{NAME_PREFIX}{topic}")
        # A restarted run publishes anew: its ids name the run (as its children's do).
        run = self._rt.run
        where = self._rt.instance_id if run == 1 else f"{self._rt.instance_id}/run{run}"
        record = replace(record, id=f"{where}/{step_key}")
        fut = self._rt.step_future(step_key, publish_body, (record,), {}, PUBLISH_RETRY, None)
        return _published(fut)

    def sleep(self, name: str, duration: float | timedelta) -> Coroutine[Any, Any, None]:
        """Sleep durably for ``duration`` (seconds or timedelta); survives restarts."""
        refuse_in_step_body("ctx.sleep")
        delay_ms = round(_seconds(duration) * 1000)
        return _awaiting(self._rt.sleep_future(self._rt.key_for(name), delay_ms=delay_ms))

    def sleep_until(self, name: str, when: datetime) -> Coroutine[Any, Any, None]:
        refuse_in_step_body("ctx.sleep_until")
        if when.tzinfo is None:
            raise ValueError("sleep_until needs a timezone-aware datetime (e.g. UTC)")
        wake_at_ms = int(when.timestamp() * 1000)
        return _awaiting(self._rt.sleep_future(self._rt.key_for(name), wake_at_ms=wake_at_ms))

    def wait_for_event(
        self,
        name: str,
        *,
        timeout: float | timedelta | None = None,
        key: str | None = None,
    ) -> Coroutine[Any, Any, Any]:
        """Wait for an event called ``name`` sent to this instance and return its payload.
        Events sent earlier are buffered and claimed in order of arrival; waiting for the
        same name again takes the next one. Raises ``EventTimeout`` after ``timeout``.
        ``key`` names the wait for replay instead of the event name."""
        refuse_in_step_body("ctx.wait_for_event")
        limit = None if timeout is None else round(_seconds(timeout) * 1000)
        return _awaiting(self._rt.wait_future(self._rt.key_for(key or name), name, limit))

    async def loop(self, name: str, body: LoopBody, *, state: Any = None, keep: int = 10) -> Any:
        """Run ``body(ctx, state)`` until it returns ``Break(value)``; ``Continue(s)``
        runs it again with ``s``. Each iteration is a scope (``<name>/<i>/``); the state
        is recorded after each one, replay starts at the last, and the records of
        iterations older than the last ``keep`` are pruned, so an endless loop holds
        bounded history, state and replay time. The state must be encodable by the
        payload codec (JSON by default: a tuple comes back as a list)."""
        refuse_in_step_body("ctx.loop")
        if not whole_in(keep, 1):
            raise InvalidWorkflowCall(
                f"loop {name!r}: keep must be a whole number of at least 1, not {keep!r}"
            )
        return await run_loop(self, self._rt.key_for(name), body, state, keep)

    async def start_child(
        self,
        workflow: str,
        input: Any = None,
        *,
        instance_id: str | None = None,
        name: str | None = None,
    ) -> ChildHandle:
        """Start a child workflow (the latest version of ``workflow``) and return its
        handle at once; ``await handle.result()`` waits for it. The child may live on
        another partition and worker. Its id defaults to ``<parent id>/<key>``; starting
        is recorded, so replay and restarts never start it twice. Cancelling the parent
        cancels the children it still waits for. ``name``: the replay key (default: the
        workflow's name)."""
        refuse_in_step_body("ctx.start_child")
        key = self._rt.key_for(name or workflow)
        return ChildHandle(self._rt, key, self._rt.start_child(key, workflow, input, instance_id))

    async def child(
        self,
        workflow: str,
        input: Any = None,
        *,
        instance_id: str | None = None,
        name: str | None = None,
    ) -> Any:
        """Start a child workflow and wait for its result; ``ChildFailed`` if it failed
        or was cancelled."""
        handle = await self.start_child(workflow, input, instance_id=instance_id, name=name)
        return await handle.result()

    @contextlib.asynccontextmanager
    async def saga(self, name: str) -> AsyncIterator[None]:
        """A rollback checkpoint (and a scope): if an exception leaves the block, its
        compensable steps still running are waited for, then the ``compensate=``
        functions of those that succeeded run newest first (by recorded start), each as
        a durable step, and ``RolledBack`` is raised with the exception as its
        ``cause``. A saga that ends well hands its steps to the saga around it."""
        refuse_in_step_body("ctx.saga")
        key = self._rt.key_for(name)
        frame = SagaFrame(key)
        outer = current_saga.get()
        scope_token = current_scope.set(key + "/")
        saga_token = current_saga.set(frame)
        try:
            try:
                yield
            finally:
                current_saga.reset(saga_token)  # compensations belong to no saga
        except Exception as exc:
            raise await roll_back(self._rt, frame, exc) from exc
        finally:
            current_scope.reset(scope_token)
        hand_over(frame, outer)

    @contextlib.asynccontextmanager
    async def scope(self, name: str) -> AsyncIterator[None]:
        """Names used inside the block are prefixed with this scope's name, so a block
        (a helper, a loop body) can reuse names without clashing with the code around it.
        Scopes repeat like names: the second ``scope("item")`` is ``item#2``."""
        refuse_in_step_body("ctx.scope")
        token = current_scope.set(self._rt.key_for(name) + "/")
        try:
            yield
        finally:
            current_scope.reset(token)

    async def join(self, branches: dict[str, Branch], *, name: str = "join") -> dict[str, Any]:
        """Run ``branches`` (``async (ctx) -> value``) concurrently, each in its own scope
        (``join/<branch>/...``), and return their values by name once all finished. If
        any raised, every branch still settles first, then ``JoinError`` carries the
        errors and the values of the others."""
        refuse_in_step_body("ctx.join")
        check_branches("join", branches)
        if not branches:
            return {}  # as asyncio.gather() of nothing: no name is used
        return await branches_join(self, self._rt.key_for(name), branches)

    async def race(self, branches: dict[str, Branch], *, name: str = "race") -> tuple[str, Any]:
        """Run ``branches`` concurrently, each in its own scope; the first to finish wins
        and is recorded, and ``(winner, value)`` is returned. The others are cancelled:
        their running attempts given up, their waits withdrawn (an event never goes to
        them) and their timers cancelled. Replay runs only the recorded winner. A branch
        that raises does not win; ``RaceError`` if every branch raised."""
        refuse_in_step_body("ctx.race")
        check_branches("race", branches)
        if not branches:
            raise InvalidWorkflowCall("ctx.race needs at least one branch: nothing can win none")
        return await branches_race(self, self._rt.key_for(name), branches)

    def patched(self, patch_id: str) -> bool:
        """Whether this run takes the new code path of a change (``if ctx.patched(...):
        new else: old``): True for instances that reach this point with the new code
        (recorded), False while replaying a history made before the change. Keep the
        old path until no instance from before the change is running."""
        refuse_in_step_body("ctx.patched")
        return self._rt.patched(patch_id)

    def removed(self, name: str) -> None:
        """Where code used to run the step, sleep or wait ``name``: a history recorded
        with it replays without it (its entry counts as reached) instead of diverging.
        Call it where the removed call was, in the same scope."""
        refuse_in_step_body("ctx.removed")
        self._rt.removed(self._rt.key_for(name))

    def set_attributes(self, attributes: Mapping[str, str | int | float | bool | None]) -> None:
        """Search attributes of this instance (``client.list_page(where=...)`` finds it by
        them): each key a name without ``=``, each value a str, int, float or bool; a
        later call merges into what earlier ones set, and None removes a key. Recorded:
        replay applies the record and does not record again. ``InvalidWorkflowCall``
        names a key whose value cannot be an attribute."""
        refuse_in_step_body("ctx.set_attributes")
        if not isinstance(attributes, Mapping):
            raise InvalidWorkflowCall(
                f"ctx.set_attributes takes a dict, not {type(attributes).__name__}"
            )
        self._rt.set_attributes(dict(attributes))

    def now(self) -> datetime:
        """The current time, recorded: replay returns the same value."""
        refuse_in_step_body("ctx.now")
        ms: int = self._rt.record_value("now", self._rt.now_ms)
        return datetime.fromtimestamp(ms / 1000, tz=UTC)

    def uuid(self) -> _uuid.UUID:
        """A random UUID, recorded."""
        refuse_in_step_body("ctx.uuid")
        return _uuid.UUID(self._rt.record_value("uuid", lambda: str(_uuid.uuid4())))

    def random(self) -> float:
        """A float in [0, 1), recorded."""
        refuse_in_step_body("ctx.random")
        value: float = self._rt.record_value("random", _random.random)
        return value
