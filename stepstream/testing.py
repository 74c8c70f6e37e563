"""Testing workflows: replay recorded histories in pytest, and run workflows on a
throwaway embedded engine whose clock moves only when the test says so.

    from stepstream.testing import WorkflowEnvironment, replay

    def test_old_orders_still_replay():
        replay("tests/histories/o-1.json", [orders])     # raises HistoryDiverged

    async def test_reminder():
        async with WorkflowEnvironment([reminders], clock="virtual") as env:
            await env.client.start("reminder", {"days": 30}, instance_id="r-1")
            await env.advance(30 * 86400)   # timers due by then fire, in order
            await env.crash()               # restart from the log, as after kill -9
            assert await env.client.result("r-1") == "sent"

``env.advance`` moves the virtual clock the way real time would pass: each timer due
before the target fires at its own time, and what it sets off (steps, new timers) runs
before the clock moves further. Step bodies run for real, in real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import tempfile
import types
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from stepstream.consumers import state_keys
from stepstream.consumers.embedded.partition import EmbeddedPartition
from stepstream.consumers.instance_store import load_state
from stepstream.engine.api.outbox import MemoryOutbox, OutboxRecord
from stepstream.engine.api.workflow import Registry, WorkflowDefinition, definition_of
from stepstream.engine.errors import ConnectionFailed, StepstreamError, UnknownWorkflow
from stepstream.engine.replay.state import EntryState
from stepstream.engine.seams import Clock, SystemClock
from stepstream.engine.virtual_clock import VirtualClock
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.engine.wire.topics import COMMANDS, TIMERS
from stepstream.ops.embedded import EmbeddedConfig, EmbeddedEngine, open_embedded
from stepstream.ops.tools.history_export import ExportedHistory
from stepstream.ops.tools.replay.replayer import replay_history
from stepstream.ops.tools.replay.results import ReplayDiverged, ReplayResult
from stepstream.ops.tools.replay.sources import History, read_files
from stepstream.producers.client import Client, Transport

__all__ = [
    "ReplayDiverged",
    "ReplayResult",
    "VirtualClock",
    "WorkflowEnvironment",
    "replay",
]

Workflows = Registry | types.ModuleType | str | Callable[..., Any] | Iterable[Any]

DEFAULT_SETTLE_TIMEOUT_S = 30.0
# Client calls a crash may interrupt that are safe to make again on the restarted engine:
# reads, and a start (idempotent on its instance id). Others may or may not have applied.
_RETRY_AFTER_CRASH = frozenset({"start", "status", "result", "history", "list"})


def as_registry(workflows: Workflows) -> Registry:
    """A registry of ``workflows``: a Registry as it is, or modules (objects or names,
    a string may list several, comma-separated), @workflow functions, or a list of those."""
    if isinstance(workflows, Registry):
        return workflows
    registry = Registry()
    if not _single(workflows) and not isinstance(workflows, Iterable):
        raise TypeError(
            f"{workflows!r} is not a workflow: pass @workflow functions, modules holding them, "
            "module names or a Registry"
        )
    items = [workflows] if _single(workflows) else list(cast(Iterable[Any], workflows))
    for item in items:
        if isinstance(item, str):
            registry.add_modules(item)
        elif isinstance(item, types.ModuleType):
            found = [d for d in map(definition_of, vars(item).values()) if d is not None]
            if not found:
                raise UnknownWorkflow(f"module {item.__name__!r} defines no @workflow functions")
            for definition in found:
                registry.add(definition)
        elif isinstance(item, WorkflowDefinition) or definition_of(item) is not None:
            registry.add(item)
        else:
            raise TypeError(
                f"{item!r} is not a workflow: pass @workflow functions, modules holding them, "
                "module names or a Registry"
            )
    return registry


def _single(workflows: Any) -> bool:
    return isinstance(workflows, str | types.ModuleType | WorkflowDefinition) or callable(workflows)


# ---- replay ------------------------------------------------------------------------------


def replay(
    history: str | os.PathLike[str] | ExportedHistory,
    workflows: Workflows,
    *,
    codec: PayloadCodec | None = None,
) -> ReplayResult:
    """Replay ``workflows`` (today's code) against a recorded history: a file written by
    ``stepstream history ID --export FILE``. Nothing runs but the workflow code: step
    bodies are not called. Raises ``HistoryDiverged`` (a ``ReplayDiverged``, with
    ``key``, ``recorded`` and ``reached``) where the code no longer matches, and
    ``UnknownWorkflow`` when ``workflows`` lack the history's workflow version. Returns the
    result: ``result.result`` is what the code returned, if the history ends completed."""
    if isinstance(history, ExportedHistory):
        found = History(history.instance_id, history.records)
        where = f"instance {history.instance_id}"
    else:
        found = read_files([history])[0]
        where = os.fspath(history)
    result = replay_history(found, as_registry(workflows), codec=codec)
    if result.outcome == "diverged":
        raise ReplayDiverged(
            f"{where}: instance {result.instance_id} ({result.workflow} v{result.version}) "
            f"diverged at {result.key!r}: the history has {result.recorded}, the code "
            f"reached {result.reached}. {result.message}",
            key=result.key,
            recorded=result.recorded,
            reached=result.reached,
            instance_id=result.instance_id,
        )
    if result.outcome == "missing":
        raise UnknownWorkflow(f"{where}: {result.message}")
    if result.outcome != "ok":
        raise StepstreamError(f"{where}: cannot replay: {result.message}")
    return result


# ---- the test environment -------------------------------------------------------------------


class WorkflowEnvironment:
    """An embedded engine in a temporary directory, for tests::

        async with WorkflowEnvironment(workflows, clock="virtual") as env:
            env.client        # a Client; it keeps working across env.crash()
            await env.advance(seconds)
            await env.crash()

    ``clock``: "virtual" (moves only with ``advance``; starts at ``start`` or now),
    "system" (wall time), or any object with ``now_ms()`` and ``async sleep(seconds)``.
    Finished instances are kept for good (no retention), so moving the clock months on
    forgets nothing. ``data_dir``: keep the data there instead of a temporary directory.
    ``ctx.publish`` records are kept in ``env.published`` (no Kafka needed), across
    crashes.
    """

    def __init__(
        self,
        workflows: Workflows,
        clock: str | Clock = "virtual",
        *,
        start: datetime | None = None,
        partitions: int = 1,
        data_dir: str | os.PathLike[str] | None = None,
        codec: PayloadCodec | None = None,
        settle_timeout: float = DEFAULT_SETTLE_TIMEOUT_S,
    ) -> None:
        self._registry = as_registry(workflows)
        if clock == "virtual":
            start_ms = None if start is None else round(start.timestamp() * 1000)
            self._clock: Clock = VirtualClock(start_ms)
        elif clock == "system":
            if start is not None:
                raise ValueError("start= needs clock='virtual': the system clock cannot be set")
            self._clock = SystemClock()
        elif isinstance(clock, str):
            raise ValueError(f"clock must be 'virtual', 'system' or a Clock, not {clock!r}")
        else:
            self._clock = clock
        self._partitions = partitions
        self._given_dir = None if data_dir is None else os.fspath(data_dir)
        self._temporary: tempfile.TemporaryDirectory[str] | None = None
        self._codec = codec
        self._settle_timeout = settle_timeout
        self._engine: EmbeddedEngine | None = None
        self._client: Client | None = None
        self._ready = asyncio.Event()
        self._running = False  # from start() to close(), crashes included
        self._crashed = asyncio.Event()  # set (and replaced) by each crash
        self._writes_before = 0  # durable writes of engines before the running one
        self.crashes = 0
        self.data_dir = self._given_dir or ""
        self._outbox = MemoryOutbox()

    # ---- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> WorkflowEnvironment:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._engine is not None:
            return
        if self._given_dir is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="stepstream-test-")
            self.data_dir = self._temporary.name
        self._engine = await self._open()
        self._client = Client(cast(Transport, _EnvironmentTransport(self)))
        self._running = True
        self._ready.set()

    async def close(self) -> None:
        """Stop the engine (letting running attempts finish for a moment) and remove the
        temporary directory."""
        engine, self._engine = self._engine, None
        self._running = False
        self._ready.clear()
        try:
            if engine is not None:
                await engine.close()
        finally:
            if self._temporary is not None:
                self._temporary.cleanup()
                self._temporary = None

    async def _open(self) -> EmbeddedEngine:
        config = EmbeddedConfig(
            data_dir=self.data_dir,
            partitions=self._partitions,
            retention_s=0,
            drain_timeout_s=1.0,
        )
        return await open_embedded(
            self._registry, config, codec=self._codec, clock=self._clock, outbox=self._outbox
        )

    @property
    def published(self) -> list[OutboxRecord]:
        """What ``ctx.publish`` produced, in order (``topic``, ``key``, ``value`` as bytes,
        ``headers``, ``id``); a publish repeated after a crash shows twice, with one id."""
        return list(self._outbox.records)

    @property
    def client(self) -> Client:
        if self._client is None:
            raise StepstreamError("the environment is not started: use `async with`")
        return self._client

    @property
    def engine(self) -> EmbeddedEngine:
        if self._engine is None:
            raise StepstreamError("the environment is not running (not started, or closed)")
        return self._engine

    async def _running_engine(self, what: str) -> None:
        """Wait out a crash's restart; refuse at once when nothing will ever run."""
        if not self._running:
            raise StepstreamError(
                f"{what} needs a running environment: use `async with "
                "WorkflowEnvironment(...) as env:` (or `await env.start()`), and call it "
                "inside the block"
            )
        await self._ready.wait()

    @property
    def clock(self) -> Clock:
        return self._clock

    def now(self) -> datetime:
        """The engine's time (the virtual clock's, when it is virtual)."""
        return datetime.fromtimestamp(self._clock.now_ms() / 1000, tz=UTC)

    @property
    def writes(self) -> int:
        """Durable writes (commits) made since the environment started, across crashes."""
        return self._writes_before + (
            0 if self._engine is None else self._engine.db.writes_committed
        )

    # ---- time -----------------------------------------------------------------------------

    async def advance(self, seconds: float | timedelta) -> None:
        """Move the virtual clock ``seconds`` on, as if that much time passed: timers due
        on the way fire at their own times, in order, and what they set off (steps, new
        timers) is done before the clock moves further. Returns once the engine has
        nothing left to do at the new time."""
        clock = self._clock
        if not isinstance(clock, VirtualClock):
            raise StepstreamError("advance() needs WorkflowEnvironment(..., clock='virtual')")
        step = seconds.total_seconds() if isinstance(seconds, timedelta) else float(seconds)
        if step < 0:
            raise ValueError(f"advance() moves time forward, not by {step} s")
        if not self._running:
            await self._running_engine("env.advance()")
        target = clock.now_ms() + round(step * 1000)
        await self.settle()
        while True:
            due = self._next_timer_ms()
            if due is None or due > target:
                break
            clock.set_ms(max(due, clock.now_ms()))
            await self.settle()
        clock.set_ms(target)
        await self.settle()

    async def settle(self, timeout: float | None = None) -> None:
        """Wait until the engine has nothing left to do at the current time: every command
        applied, no timer due, no step attempt running. Raises ``StepstreamError`` naming
        what is still busy after ``timeout`` seconds (the environment's settle_timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self._settle_timeout if timeout is None else timeout)
        quiet = 0
        while quiet < 2:
            await self._running_engine("env.settle()")
            busy = self._busy()
            if busy is None:
                quiet += 1
                await asyncio.sleep(0)
                continue
            quiet = 0
            if loop.time() > deadline:
                raise StepstreamError(f"the engine is still busy after the settle timeout: {busy}")
            await asyncio.sleep(0.001)

    def _busy(self) -> str | None:
        """What the engine still has to do at the current time, read from its durable
        state (so work in flight in memory is never missed) and from the step attempts
        and outcomes it holds, or None."""
        engine = self.engine
        now = self._clock.now_ms()
        # In memory too: an ephemeral step records nothing until its outcome is committed.
        running = engine.host.executor.running()
        if running:
            instance_id, step, attempt = running[0]
            return f"step {step!r} of instance {instance_id} is running (attempt {attempt})"
        for p in range(engine.db.partitions):
            pending = engine.host.processor(p).outcomes_pending
            if pending:
                return f"partition {p} has {pending} step outcome(s) to commit"
            partition = EmbeddedPartition(engine.db, p)
            for kind in (COMMANDS, TIMERS):
                behind = partition.end_offset(kind) - partition.committed_offset(kind)
                if behind > 0:
                    return f"partition {p} has {behind} {kind} record(s) to apply"
            store = partition.store
            first = next(iter(store.scan(state_keys.TIMER)), None)
            if first is not None:
                fire_at, instance_id, timer_id = state_keys.split_timer(first[0])
                if fire_at <= now:
                    return f"timer {timer_id} of instance {instance_id} is due"
            for key, _ in store.scan(state_keys.ACTIVE):
                state = load_state(store, state_keys.split_active(key))
                if state is None:
                    continue
                for entry in state.entries.values():
                    if entry.state is EntryState.RUNNING:
                        return (
                            f"step {entry.key!r} of instance {state.instance_id} is running "
                            f"(attempt {entry.attempt})"
                        )
        return None

    def _next_timer_ms(self) -> int | None:
        engine = self.engine
        earliest: int | None = None
        for p in range(engine.db.partitions):
            store = EmbeddedPartition(engine.db, p).store
            first = next(iter(store.scan(state_keys.TIMER)), None)
            if first is not None:
                fire_at = state_keys.split_timer(first[0])[0]
                earliest = fire_at if earliest is None else min(earliest, fire_at)
        return earliest

    # ---- crashes --------------------------------------------------------------------------

    async def crash(self, *, after_writes: int | None = None) -> None:
        """Stop the engine as a kill -9 would (nothing drained, nothing more written,
        running step attempts abandoned) and start it again from its data directory:
        instances recover from what was durable. ``after_writes``: first let that many
        more commits happen (or the engine settle), to crash in the middle of things."""
        if after_writes is not None:
            await self._wait_writes(self.writes + after_writes)
        engine = self.engine
        self._ready.clear()
        crashed, self._crashed = self._crashed, asyncio.Event()
        crashed.set()
        self._writes_before += engine.db.writes_committed
        for partition in engine.host.owned:
            await engine.host.revoke(partition)
        engine.host.executor.shutdown()
        await engine.db.close()
        self._engine = None
        self._engine = await self._open()
        self.crashes += 1
        self._ready.set()

    async def _wait_writes(self, target: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settle_timeout
        while self.writes < target and loop.time() < deadline:
            if self._busy() is None:
                return  # nothing more will be written unless time moves
            await asyncio.sleep(0)

    async def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A client call on the engine running now; one that a crash interrupts is made
        again on the restarted engine if that is safe, else raises ConnectionFailed."""
        while True:
            await self._running_engine(f"env.client.{name}()")
            crashed = self._crashed
            method: Callable[..., Awaitable[Any]] = getattr(self.engine.transport, name)
            call = asyncio.ensure_future(method(*args, **kwargs))
            interrupted = asyncio.ensure_future(crashed.wait())
            try:
                await asyncio.wait((call, interrupted), return_when=asyncio.FIRST_COMPLETED)
            finally:
                interrupted.cancel()
                if not call.done():
                    call.cancel()
                    with contextlib.suppress(BaseException):
                        await call
            if not call.cancelled():
                return call.result()
            if name not in _RETRY_AFTER_CRASH:
                raise ConnectionFailed(
                    f"the engine crashed (env.crash()) during {name}(); the command may or "
                    "may not have been applied: check the instance's status"
                )


class _EnvironmentTransport:
    """The client's transport: the running engine's, whichever that is after crashes."""

    def __init__(self, env: WorkflowEnvironment) -> None:
        self._env = env

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._env.engine.transport, name)
        if not inspect.iscoroutinefunction(target):
            return target

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._env._call(name, args, kwargs)

        return call

    async def close(self) -> None:
        """The environment closes its engine; closing its client does nothing."""
