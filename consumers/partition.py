"""The partition processor: owns one partition of commands and its instances.

For each batch of inputs (commands from the log, step outcomes from the executor): load
or reuse the instance runtime, let it decide records, then make everything durable in
one commit (history and timer records appended, state and the consumed offset written
together). Only after that commit are step bodies launched and waiters told. Inputs that
arrive while a commit is in flight form the next batch: that is the group commit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepstream.consumers import state_keys as keys
from stepstream.consumers.dead_letters import dead_letter
from stepstream.consumers.hooks import HookConfig, HookRunner
from stepstream.consumers.instance_store import InstanceReads, write_state
from stepstream.consumers.retention import Sweeper
from stepstream.consumers.runtime_cache import RuntimeCache
from stepstream.consumers.steps import StepExecutor
from stepstream.consumers.telemetry import Telemetry
from stepstream.consumers.timers import OwnFires, unindex
from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import (
    HistoryDiverged,
    StepstreamError,
    UndecodableRecord,
    UnknownWorkflow,
)
from stepstream.engine.replay.effects import Output, StepOutcome
from stepstream.engine.replay.ids import is_client_command, parse_child_command
from stepstream.engine.replay.outgoing import child_outcome
from stepstream.engine.replay.runtime import InstanceRuntime
from stepstream.engine.replay.state import EntryState, InstanceState, Status
from stepstream.engine.replay.state_json import state_from_storage
from stepstream.engine.seams import (
    Append,
    Clock,
    CommitBatch,
    LogEntry,
    PartitionBackend,
    PartitionLost,
)
from stepstream.engine.wire.codec import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PayloadCodec,
    check_size,
    decode_safely,
    encode_safely,
)
from stepstream.engine.wire.names import name_problem
from stepstream.engine.wire.records import (
    Command,
    PartitionFenced,
    Payload,
    SendEvent,
    SleepStarted,
    StartWorkflow,
    TimerFired,
    TimerScheduled,
)
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.settle import UNKNOWN_INSTANCE, ignored_reason
from stepstream.engine.wire.topics import COMMANDS, HISTORY, TIMERS, partition_for

log = logging.getLogger("stepstream.partition")

RESTART_BACKOFF_S = 0.1
DEFAULT_DRAIN_TIMEOUT_S = 10.0
DEFAULT_RETENTION_S = 30 * 24 * 3600.0
SWEEP_INTERVAL_S = 60.0
MAX_RESTART_BACKOFF_S = 30.0
# A timer fire that hit an internal error is fired again after this long (the instance is
# re-driven at once; a bug that is not transient is retried this slowly).
REFIRE_AFTER_INTERNAL_ERROR_S = 1.0


@dataclass(frozen=True, slots=True)
class ProcessorConfig:
    max_batch: int = 1000
    cache_size: int = 10_000
    # An instance whose only business is a sleep due later than this (seconds) leaves
    # the cache once its records are durable: a million sleepers do not sit in memory
    # (where every full garbage collection walks them) to be replayed in a few ms when
    # they wake.
    evict_sleepers_after_s: float = 60.0
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    # On a graceful hand-over (revoke, shutdown): how long step attempts that are
    # running may take to finish and be recorded before the partition is let go.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # How long a finished instance (status, result, history) stays readable after it
    # finished; then its state is deleted and an InstanceForgotten recorded (the Kafka
    # history topic keeps its records; the embedded log drops them). 0: for ever.
    retention_s: float = DEFAULT_RETENTION_S
    sweep_interval_s: float = SWEEP_INTERVAL_S


@dataclass(frozen=True, slots=True)
class Committed:
    """What one commit changed, for waiters: instances touched and commands settled
    (command id -> None when applied, or the reason it was dead-lettered)."""

    instances: list[InstanceState]
    commands: dict[str, str | None]
    replies: dict[str, Payload] = field(default_factory=dict)  # message id -> answer


class PartitionProcessor:
    def __init__(
        self,
        backend: PartitionBackend,
        registry: Registry,
        *,
        serde: RecordSerde,
        codec: PayloadCodec,
        clock: Clock,
        executor: StepExecutor,
        on_commit: Callable[[Committed], None],
        config: ProcessorConfig | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.backend = backend
        self.partition = backend.partition
        self._registry = registry
        self._serde = serde
        self._codec = codec
        self._clock = clock
        self._executor = executor
        self._on_commit = on_commit
        self._config = config = config or ProcessorConfig()
        self._telemetry = telemetry = telemetry or Telemetry()
        # Instances parked here (history diverged, or their version is not deployed).
        self.parked: set[str] = set()
        self.reads = InstanceReads(backend.store, serde)
        self._cache = RuntimeCache(
            backend.store,
            registry,
            partition=backend.partition,
            codec=codec,
            clock=clock,
            epoch=backend.epoch,
            max_payload_bytes=config.max_payload_bytes,
            size=config.cache_size,
            telemetry=telemetry,
        )
        # Hooks (on_error, on_status_change): their outbox is written ahead of each commit.
        self._hooks = HookRunner(
            backend, registry, serde=serde, config=HookConfig.from_env(os.environ)
        )
        self._sweeper = Sweeper(
            backend,
            self._cache,
            serde=serde,
            clock=clock,
            retention_s=config.retention_s,
            interval_s=config.sweep_interval_s,
        )
        self._outcomes: list[StepOutcome] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._fetch: asyncio.Task[list[LogEntry]] | None = None
        self._source = backend.source(COMMANDS)
        self._committed = asyncio.Event()
        # Instances whose earlier inputs in the batch being processed were undone.
        self._poisoned: set[str] = set()
        # Instances any input of the batch being processed hit an internal error on: they
        # are reloaded and driven from their committed state after the commit.
        self._redrive: set[str] = set()
        # Timer fires that hit an internal error: scheduled again, a little later.
        self._refires: list[TimerScheduled] = []
        # Commands for other instances decided here, not by a runtime (a child that could
        # not start tells its parent).
        self._notices: list[Command] = []
        self._last_instance = ""  # the instance the last command applied to
        # Fires this partition's timer service appended: read back without decoding.
        self.own_fires = OwnFires()
        # Timer fires handed over directly by the timer service (``fire``), and those of
        # the batch being processed (given back if its commit fails).
        self._fires: list[TimerFired] = []
        self._fires_in_batch: list[TimerFired] = []

    # ---- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Fence the partition, resume unfinished instances, then start consuming."""
        await self._resume()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _resume(self) -> None:
        out = Output()
        batch = CommitBatch()
        fence = PartitionFenced(
            instance_id="",
            time_ms=self._clock.now_ms(),
            command_id=f"fence:{self.backend.epoch}",
            epoch=self.backend.epoch,
            partition=self.partition,
        )
        batch.appends.append(Append(HISTORY, b"", self._serde.encode(fence), self.partition))
        touched: dict[str, InstanceRuntime] = {}
        for key, _ in list(self.backend.store.scan(keys.ACTIVE)):
            instance_id = keys.split_active(key)
            runtime = self._cache.load(instance_id)
            if runtime is None:
                continue
            try:
                runtime.recover(out)
            except HistoryDiverged as exc:
                self._park(runtime, exc, out, touched, None)
                continue
            touched[instance_id] = runtime
        self._index_finished(batch)
        await self._commit(out, touched, batch, {})
        if touched:
            log.info("partition=%d resumed %d unfinished instances", self.partition, len(touched))
        parked = sum(1 for rt in touched.values() if rt.state.parked)
        if parked:
            log.warning(
                "partition=%d: %d instances parked (history diverged from the code, their "
                "version is not deployed here, or this engine's payload codec cannot read "
                "them); stepstream list --diverged lists the diverged ones, stepstream "
                "status ID says why one is parked",
                self.partition,
                parked,
            )

    def _index_finished(self, batch: CommitBatch) -> None:
        """Once per state store: index the instances that finished before finish times
        were indexed (state written by an older version), so retention reaches them."""
        store = self.backend.store
        if store.get(keys.FINISHED_INDEXED) is not None:
            return
        for key, meta in store.scan(keys.META):
            state = state_from_storage(keys.split_meta(key), meta, [])
            if state.status.finished:
                batch.put(keys.finished(state.finished_ms, state.instance_id), b"")
        batch.put(keys.FINISHED_INDEXED, b"")

    async def stop(self) -> None:
        for task in (self._task, self._fetch):
            if task is not None:
                task.cancel()
        for task in (self._task, self._fetch):
            if task is not None:
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        await self._hooks.stop()
        self._cache.clear()

    async def drain(self, timeout: float | None = None) -> int:
        """Let running step attempts finish and be recorded, starting nothing new, for
        up to ``timeout`` seconds (the config's by default). Returns how many were still
        running when it gave up: the next owner records those as lost attempts."""
        self._cache.drain()
        self._wake.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self._config.drain_timeout_s if timeout is None else timeout)
        while self._cache.running_attempts() and self._task is not None and not self._task.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self._committed.clear()
            try:
                await asyncio.wait_for(self._committed.wait(), remaining)
            except TimeoutError:
                break
        await self._hooks.drain(max(0.0, deadline - loop.time()))  # hooks: calls owed
        left = self._cache.running_attempts()
        if left:
            log.warning(
                "partition=%d: %d step attempts still running after the drain timeout "
                "(STEPSTREAM_DRAIN_TIMEOUT_S); the next owner records them as lost attempts",
                self.partition,
                left,
            )
        return left

    @property
    def cached(self) -> int:
        """Instance runtimes held in memory."""
        return len(self._cache)

    @property
    def lag(self) -> int:
        """Commands on the partition not yet applied, as far as the backend knows."""
        backend = self.backend
        return max(0, backend.end_offset(COMMANDS) - backend.committed_offset(COMMANDS))

    def deliver(self, outcome: StepOutcome) -> None:
        self._outcomes.append(outcome)
        self._wake.set()

    def caught_up(self) -> bool:
        """Whether every command below the end of the partition's commands, as the log
        last told it, is applied and committed (and nothing fetched waits): a timer that
        fires now may then be applied without going round the commands topic, and still
        comes after every command acknowledged before that end was heard."""
        fetch = self._fetch
        if (
            fetch is not None
            and fetch.done()
            and (fetch.cancelled() or fetch.exception() or fetch.result())
        ):
            return False  # fetched, not applied yet (an empty fetch leaves nothing behind)
        end = self._source.end_heard()
        return end is not None and self.backend.committed_offset(COMMANDS) >= end

    def fire(self, fires: list[TimerFired]) -> None:
        """Due timers from this partition's timer service, applied in the next batch
        (asked only while ``caught_up``). Their index keys go with that batch's commit."""
        self._fires.extend(fires)
        self._wake.set()

    # ---- the loop -------------------------------------------------------------------

    async def join(self) -> None:
        """Until the processing loop ends: after ``stop``, or by itself once the backend
        gave the partition up (``PartitionLost``: revoked, or a disk that takes no more
        writes)."""
        if self._task is not None:
            await asyncio.wait({self._task})

    async def _run(self) -> None:
        backoff = RESTART_BACKOFF_S
        reload = False
        while True:
            try:
                if reload:
                    await self._reset()
                    reload = False
                    backoff = RESTART_BACKOFF_S
                await self._consume()
            except PartitionLost as exc:
                # Retrying cannot help (the next owner, or the next start, goes on from
                # what is durable), also when it is the reload after another failure
                # that meets it.
                log.warning("partition=%d: stopped processing: %s", self.partition, exc)
                self._hooks.halt()
                return
            except Exception as exc:
                # A commit failed (or a bug escaped). Memory may be ahead of what is
                # durable: forget it, go back to the last commit and resume from there;
                # a reload that fails is tried again, never skipped.
                log.log(
                    logging.ERROR,
                    "partition=%d: %s failed; reloading from the last commit in %.1f s%s",
                    self.partition,
                    "reload" if reload else "processing",
                    backoff,
                    f": {exc}" if isinstance(exc, StepstreamError) else "",
                    exc_info=not isinstance(exc, StepstreamError),
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_RESTART_BACKOFF_S)
                reload = True

    async def _reset(self) -> None:
        if self._fetch is not None:
            self._fetch.cancel()
            try:
                await self._fetch
            except (asyncio.CancelledError, Exception):
                pass
            self._fetch = None
        self._cache.clear()
        self._outcomes.clear()  # attempts still running are recovered as lost attempts
        # Fires of the failed batch are not committed: they are applied anew.
        self._fires[:0] = self._fires_in_batch
        self._fires_in_batch = []
        self._source.rewind(self.backend.committed_offset(COMMANDS))
        await self._resume()

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        wake_task: asyncio.Task[bool] | None = None
        try:
            while True:
                if self._fetch is None and not self._cache.draining:
                    fetch = self._source.fetch(self._config.max_batch, 1.0)
                    self._fetch = loop.create_task(fetch)
                if (
                    not self._outcomes
                    and not self._fires
                    and (self._fetch is None or not self._fetch.done())
                ):
                    if wake_task is None or wake_task.done():
                        self._wake.clear()
                        wake_task = loop.create_task(self._wake.wait())
                    waits: set[asyncio.Future[Any]] = {wake_task}
                    if self._fetch is not None:
                        waits.add(self._fetch)
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                entries: list[LogEntry] = []
                if self._fetch is not None and self._fetch.done():
                    entries = self._fetch.result()
                    self._fetch = None
                outcomes, self._outcomes = self._outcomes, []
                limit = self._config.max_batch
                fires, self._fires = self._fires[:limit], self._fires[limit:]
                if entries or outcomes or fires:
                    await self._process(entries, outcomes, fires)
                if self._sweeper.due(loop.time()):
                    await self._sweeper.sweep()
        finally:
            if wake_task is not None:
                wake_task.cancel()

    async def _process(
        self,
        entries: list[LogEntry],
        outcomes: list[StepOutcome],
        fires: list[TimerFired],
    ) -> None:
        self._fires_in_batch = fires
        out = Output()
        batch = CommitBatch()
        touched: dict[str, InstanceRuntime] = {}
        settled: dict[str, str | None] = {}
        # instance -> the inputs applied to it: a command's entry or a direct fire
        applied: dict[str, list[tuple[LogEntry | TimerFired, str]]] = {}
        undone: list[tuple[LogEntry | TimerFired, str]] = []
        self._poisoned.clear()
        self._redrive.clear()
        self._refires.clear()
        self._notices.clear()

        applied_outcomes: dict[str, list[StepOutcome]] = {}

        def undo_poisoned() -> None:
            # An instance whose decisions in this batch were all undone (so far): so are
            # the inputs before the failure that led to them (later ones apply anew).
            # Commands are dead-lettered or sent round again below; step outcomes go
            # round again, their attempts still counted as running.
            for instance_id in self._poisoned:
                undone.extend(applied.pop(instance_id, ()))
                for outcome in applied_outcomes.pop(instance_id, ()):
                    self._cache.orphaned.setdefault(instance_id, set()).add(
                        (outcome.key, outcome.attempt)
                    )
                    self._outcomes.append(outcome)
                poisoned_seen.add(instance_id)
            self._poisoned.clear()

        poisoned_seen: set[str] = set()
        for entry in entries:
            command_id, reason, rejected = self._apply_command(entry, out, touched)
            undo_poisoned()
            if rejected:
                assert reason is not None
                batch.appends.append(self._dead_letter(entry, reason, command_id))
            elif command_id and self._last_instance:
                applied.setdefault(self._last_instance, []).append((entry, command_id))
            if command_id:
                settled[command_id] = reason
        for fire in fires:  # after the commands: none of them was acknowledged later
            self._apply(fire, out, touched, direct=True)
            undo_poisoned()
            if self._last_instance:
                applied.setdefault(self._last_instance, []).append((fire, fire.command_id))
        for outcome in outcomes:
            runtime = self._cache.get(outcome.instance_id)
            if runtime is None and (
                outcome.instance_id in poisoned_seen or outcome.instance_id in self._cache.orphaned
            ):
                # Dropped after an internal error: reloaded, it keeps its running attempts.
                runtime = self._cache.load(outcome.instance_id)
            if runtime is None:
                continue  # the instance finished or was dropped; a late outcome changes nothing
            if self._guarded(runtime, outcome, out, touched) is None:
                applied_outcomes.setdefault(outcome.instance_id, []).append(outcome)
            undo_poisoned()
        again: list[TimerFired] = []
        for item, command_id in undone:
            if isinstance(item, TimerFired):
                again.append(item)  # applied again, in the next batch
                continue
            entry = item
            if is_client_command(command_id):
                reason = (
                    "not applied: a later input of its instance in the same batch hit an "
                    "internal error (see the worker's log); send the command again"
                )
                batch.appends.append(self._dead_letter(entry, reason, command_id))
                settled[command_id] = reason
            else:  # a timer fire: nobody would send it again, so it goes round again
                batch.appends.append(Append(COMMANDS, entry.key, entry.value, self.partition))
        for notice in self._notices:
            batch.appends.append(
                Append(COMMANDS, notice.instance_id.encode(), self._serde.encode(notice))
            )
        for refire in self._refires:
            batch.appends.append(
                Append(
                    TIMERS, refire.instance_id.encode(), self._serde.encode(refire), self.partition
                )
            )
        for fire in fires:
            if fire not in again:  # fired: out of the timer index with what it did
                unindex(batch, fire.fire_at_ms, fire.instance_id, fire.timer_id)
        if entries:
            batch.offsets[COMMANDS] = entries[-1].offset + 1
        await self._commit(out, touched, batch, settled)
        self._fires_in_batch = []
        if again:
            self.fire(again)
        redrive = poisoned_seen | self._redrive
        if redrive:
            await self._recover(sorted(redrive))

    async def _recover(self, instance_ids: list[str]) -> None:
        """Reload instances that hit an internal error (or whose batch was undone) and
        drive them from their committed state (attempts whose outcomes were undone or
        hit the error are recovered as lost), so they do not wait for an input that may
        never come."""
        out = Output()
        batch = CommitBatch()
        touched: dict[str, InstanceRuntime] = {}
        for instance_id in instance_ids:
            runtime = self._cache.get_or_load(instance_id)
            if runtime is None:
                continue
            own = Output()  # merged only if the whole recovery succeeds
            try:
                runtime.recover(own)
            except HistoryDiverged as exc:
                self._park(runtime, exc, own, touched, None)
                continue
            except Exception:
                log.exception(
                    "partition=%d instance=%s: recovery failed", self.partition, instance_id
                )
                self._cache.drop(instance_id)
                continue
            out.history.extend(own.history)
            out.timers.extend(own.timers)
            out.launches.extend(own.launches)
            out.cancels.extend(own.cancels)
            out.commands.extend(own.commands)
            touched[instance_id] = runtime
        await self._commit(out, touched, batch, {})

    def _apply_command(
        self, entry: LogEntry, out: Output, touched: dict[str, InstanceRuntime]
    ) -> tuple[str, str | None, bool]:
        """Apply one command. Returns its id, why it did not take effect (None if it
        did) and whether it is rejected (dead-lettered) rather than recorded as ignored."""
        self._last_instance = ""
        record: Command | None = self.own_fires.take(entry.value)
        if record is None:
            read = self._read_command(entry)
            if isinstance(read, tuple):
                return read
            record = read
        return self._apply(record, out, touched)

    def _apply(
        self,
        record: Command,
        out: Output,
        touched: dict[str, InstanceRuntime],
        *,
        direct: bool = False,
    ) -> tuple[str, str | None, bool]:
        """Apply one command read from the log, or a timer fire handed over directly."""
        self._last_instance = ""
        runtime = touched.get(record.instance_id) or self._cache.get_or_load(record.instance_id)
        if runtime is None:
            if isinstance(record, TimerFired):
                # The timer of an instance that is gone: harmless.
                return record.command_id, None, False
            if not isinstance(record, StartWorkflow):
                return (
                    record.command_id,
                    f"{UNKNOWN_INSTANCE} {record.instance_id!r}: {record.type} needs an "
                    "instance started with this id",
                    True,
                )
            try:
                definition = self._registry.resolve(record.workflow, record.version)
            except UnknownWorkflow as exc:
                self._tell_parent_child_failed(record, exc)
                return record.command_id, str(exc), True
            runtime = self._cache.new(InstanceState(record.instance_id), definition)
        elif self.reads.applied(runtime.state, record.command_id):
            return record.command_id, None, False  # re-delivered: it changes nothing
        error = self._guarded(runtime, record, out, touched)
        if error is not None and isinstance(record, TimerFired):
            # Dead-lettered, the fire would be lost (the index let the timer go when it
            # fired): it is scheduled again instead, and accepted as the timer's fire.
            self._refires.append(
                TimerScheduled(
                    instance_id=record.instance_id,
                    time_ms=self._clock.now_ms(),
                    command_id=record.command_id,
                    epoch=self.backend.epoch,
                    timer_id=record.timer_id,
                    fire_at_ms=self._clock.now_ms() + int(REFIRE_AFTER_INTERNAL_ERROR_S * 1000),
                    purpose="refire",
                )
            )
            return record.command_id, None, False
        if error is not None:
            return record.command_id, error, True
        self._last_instance = record.instance_id
        self._telemetry.command_applied(record.type)
        if isinstance(record, TimerFired):
            self._telemetry.timer_fired(
                max(0, self._clock.now_ms() - record.fire_at_ms) / 1000, direct=direct
            )
        if runtime.ignored and not isinstance(record, StartWorkflow):
            # Recorded as ignored (CommandIgnored); the publisher learns why.
            return record.command_id, ignored_reason(record, runtime.state.status.value), False
        return record.command_id, None, False

    def _read_command(self, entry: LogEntry) -> Command | tuple[str, str, bool]:
        """The command ``entry`` holds, or why it is rejected (as ``_apply_command``
        returns it): undecodable, not a command, a bad payload, or on the wrong partition."""
        try:
            record = self._serde.decode(entry.value)
        except UndecodableRecord as exc:
            return "", f"undecodable record: {exc}", True
        if not isinstance(record, Command):
            return record.command_id, f"{record.type} is not a command", True
        problem = self._check_payload(record)
        if problem is not None:
            return record.command_id, problem, True
        home = partition_for(record.instance_id, self.backend.partitions)
        if home != self.partition:
            return (
                record.command_id,
                f"misrouted: instance {record.instance_id!r} lives on partition {home}, this "
                f"record is on partition {self.partition}; produce commands keyed by "
                "instance id with Kafka's murmur2 partitioner (librdkafka: "
                "partitioner=murmur2_random)",
                True,
            )
        return record

    def _tell_parent_child_failed(self, start: StartWorkflow, exc: StepstreamError) -> None:
        """A child that cannot start (its workflow is not deployed here) tells its parent,
        which would otherwise wait for it for ever."""
        parent = parse_child_command(start.command_id)
        if parent is None:
            return
        parent_id, key = parent
        outcome = {"status": "failed", "error_type": type(exc).__name__, "error": str(exc)}
        self._notices.append(
            child_outcome(
                parent_id,
                key,
                f"childdone:{start.instance_id}",
                encode_safely(self._codec, outcome),
                self._clock.now_ms(),
            )
        )

    def _check_payload(self, command: Command) -> str | None:
        """Clients check names and payloads before publishing; this catches what got
        past them (a foreign producer)."""
        if not isinstance(command, TimerFired):
            problem = name_problem(command.instance_id)
            if problem is not None:
                return f"InvalidPayload: instance id {problem}"
        if isinstance(command, SendEvent):
            problem = name_problem(command.name)
            if problem is not None:
                return f"InvalidPayload: event name {problem}"
        if isinstance(command, StartWorkflow):
            payload, what = command.input, "workflow input"
        elif isinstance(command, SendEvent):
            payload, what = command.payload, f"payload of event {command.name!r}"
        else:
            return None
        try:
            check_size(payload, self._config.max_payload_bytes, what=what)
            decode_safely(self._codec, payload)
        except StepstreamError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _guarded(
        self,
        runtime: InstanceRuntime,
        msg: Command | StepOutcome,
        out: Output,
        touched: dict[str, InstanceRuntime],
    ) -> str | None:
        try:
            runtime.handle(msg, out)
        except HistoryDiverged as exc:
            return self._park(runtime, exc, out, touched, msg)
        except Exception as exc:
            # A bug, not user code (user exceptions stay inside the workflow task). Undo
            # this input's decisions and forget the runtime; its stored state is intact.
            log.exception(
                "partition=%d instance=%s workflow=%s: internal error",
                self.partition,
                runtime.state.instance_id,
                runtime.state.workflow,
            )
            # Undo every decision of this instance in the batch, not only this input's:
            # its in-memory state is gone, so its earlier records would have no state.
            instance_id = runtime.state.instance_id
            # Attempts started before this batch still run: whoever reloads the instance
            # must wait for them rather than count them lost.
            started_here = {
                (x.key, x.attempt) for x in out.launches if x.instance_id == instance_id
            }
            running = runtime.inflight - started_here
            if isinstance(msg, StepOutcome):
                # Its attempt ended: recovery records it as lost (its outcome is gone).
                running.discard((msg.key, msg.attempt))
            self._cache.orphaned.setdefault(instance_id, set()).update(running)
            _strip(out, instance_id)
            self._cache.drop(instance_id)
            self._redrive.add(instance_id)
            if touched.pop(instance_id, None) is not None:
                self._poisoned.add(instance_id)
            return f"internal error while applying {type(msg).__name__}: {exc!r}"
        touched[runtime.state.instance_id] = runtime
        return None

    def _park(
        self,
        runtime: InstanceRuntime,
        diverged: HistoryDiverged,
        out: Output,
        touched: dict[str, InstanceRuntime],
        msg: Command | StepOutcome | None,
    ) -> str | None:
        """The code no longer matches the instance's history: keep nothing the replay
        decided, and park the instance (status stays running, its ``error`` says where it
        diverged). Its inputs are still recorded, so nothing is lost; a worker with
        matching code drives it on when it loads it."""
        instance_id = runtime.state.instance_id
        running = set(runtime.inflight)
        _strip(out, instance_id)
        self._cache.drop(instance_id)
        parked = self._cache.load(instance_id)
        if parked is None:
            return f"HistoryDiverged: {diverged}"
        parked.inflight |= running
        parked.park(f"HistoryDiverged: {diverged}")
        if msg is not None:
            try:
                parked.handle(msg, out)
            except Exception as exc:
                log.exception(
                    "partition=%d instance=%s: internal error", self.partition, instance_id
                )
                _strip(out, instance_id)
                self._cache.drop(instance_id)
                return f"internal error while applying {type(msg).__name__}: {exc!r}"
        touched[instance_id] = parked
        log.warning(
            "partition=%d instance=%s workflow=%s parked: %s; deploy code that matches its "
            "history to let it go on (stepstream list --diverged)",
            self.partition,
            instance_id,
            parked.state.workflow,
            diverged,
        )
        return None

    # ---- persistence ----------------------------------------------------------------

    async def _commit(
        self,
        out: Output,
        touched: dict[str, InstanceRuntime],
        batch: CommitBatch,
        settled: dict[str, str | None],
    ) -> None:
        """Make what the inputs decided durable, then act on it: count it, launch the
        attempts, wake the waiters."""
        self._persist(out, touched, batch)
        await self._hooks.write_ahead(out, touched)  # hooks
        began = time.perf_counter()
        await self.backend.commit(batch)
        self._telemetry.committed(
            self.partition,
            out.history,
            touched,
            records=len(batch.appends),
            seconds=time.perf_counter() - began,
        )
        self._after_commit(out, touched, settled)

    def _persist(
        self, out: Output, touched: dict[str, InstanceRuntime], batch: CommitBatch
    ) -> None:
        encode = self._serde.encode
        appends = batch.appends
        for record in out.history:
            value = encode(record)
            instance = record.instance_id.encode()
            appends.append(Append(HISTORY, instance, value, self.partition))
            batch.put(keys.history(record.instance_id, record.seq), value)
        for timer in out.timers:
            appends.append(
                Append(TIMERS, timer.instance_id.encode(), encode(timer), self.partition)
            )
        for _, command in out.commands:  # to other instances, wherever they live
            appends.append(Append(COMMANDS, command.instance_id.encode(), encode(command)))
        for runtime in touched.values():
            out.replies.update(runtime.state.new_replies)
            write_state(runtime.state, batch)

    def _after_commit(
        self,
        out: Output,
        touched: dict[str, InstanceRuntime],
        settled: dict[str, str | None],
    ) -> None:
        for instance_id, key, attempt in out.cancels:
            self._executor.cancel(instance_id, key, attempt)
        for launch in out.launches:
            self._executor.launch(launch, self.deliver, self.partition)
        parked = self.parked
        for instance_id, runtime in touched.items():
            state = runtime.state
            if state.parked and not state.status.finished:
                parked.add(instance_id)
            elif parked:
                parked.discard(instance_id)
            if state.status.finished and not runtime.busy:
                self._cache.drop(instance_id)
        for instance_id in self._long_sleepers(out, touched):
            self._cache.drop(instance_id)
        self._cache.evict()
        self._hooks.launch()  # hooks: the records are durable now
        self._on_commit(Committed([rt.state for rt in touched.values()], settled, out.replies))
        self._committed.set()

    def _long_sleepers(self, out: Output, touched: dict[str, InstanceRuntime]) -> list[str]:
        """Instances that just started a long sleep and now wait for nothing else."""
        horizon = self._clock.now_ms() + self._config.evict_sleepers_after_s * 1000
        found = []
        for record in out.history:
            if type(record) is not SleepStarted or record.wake_at_ms <= horizon:
                continue
            runtime = touched.get(record.instance_id)
            if runtime is None or runtime.busy or runtime.state.status is not Status.RUNNING:
                continue
            state = runtime.state
            if all(
                e.state.final or (e.state is EntryState.SLEEPING and (e.fire_at_ms or 0) > horizon)
                for e in state.entries.values()
            ):
                found.append(record.instance_id)
        return found

    def _dead_letter(self, entry: LogEntry, reason: str, command_id: str = "") -> Append:
        self._telemetry.dead_lettered(reason)
        return dead_letter(
            entry,
            reason,
            serde=self._serde,
            backend=self.backend,
            clock=self._clock,
            command_id=command_id,
        )


def _strip(out: Output, instance_id: str) -> None:
    """Take every decision of one instance out of a batch's output."""
    out.history[:] = [r for r in out.history if r.instance_id != instance_id]
    out.timers[:] = [t for t in out.timers if t.instance_id != instance_id]
    out.launches[:] = [x for x in out.launches if x.instance_id != instance_id]
    out.cancels[:] = [c for c in out.cancels if c[0] != instance_id]
    out.commands[:] = [c for c in out.commands if c[0] != instance_id]
