"""The partition processor: owns one partition of commands and its instances.

For each batch of inputs (commands from the log, step outcomes from the executor): load
or reuse the instance runtime, let it decide records, then make everything durable in
one commit (history and timer records appended, state and the consumed offset written
together). Only after that commit are step bodies launched and waiters told. Inputs that
arrive while a commit is in flight form the next batch: that is the group commit.

The parts: ``Applier`` turns inputs into one ``Batch`` (the batch's whole state), with
``CommandIntake`` checking what a command must pass and ``Containment`` deciding what an
internal error or diverged history does; ``records`` turns the batch into the commit.
This module runs the loop, commits, and acts on what became durable.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from stepstream.consumers.hook_tasks import HookConfig
from stepstream.consumers.hooks import HookRunner
from stepstream.consumers.partition.apply import Applier
from stepstream.consumers.partition.batch import Batch
from stepstream.consumers.partition.intake import CommandIntake
from stepstream.consumers.partition.records import Unstorable, long_sleepers, persist
from stepstream.consumers.partition.settings import (
    MAX_RESTART_BACKOFF_S,
    RESTART_BACKOFF_S,
    Committed,
    ProcessorConfig,
)
from stepstream.consumers.retention import Sweeper
from stepstream.consumers.runtime_cache import RuntimeCache
from stepstream.consumers.steps import StepExecutor
from stepstream.consumers.telemetry import Telemetry
from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import StepstreamError
from stepstream.engine.replay.effects import StepOutcome
from stepstream.engine.seams import Clock, LogEntry, PartitionBackend, PartitionLost
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.engine.wire.records import TimerFired
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.topics import COMMANDS

log = logging.getLogger("stepstream.partition")


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
        on_forgotten: Callable[[int], None] | None = None,
        config: ProcessorConfig | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.backend = backend
        self.partition = backend.partition
        self._serde = serde
        self._clock = clock
        self._executor = executor
        self._on_commit = on_commit
        # Told how many instances each sweep forgot (the host trims the heap after many).
        self._on_forgotten = on_forgotten
        self._config = config = config or ProcessorConfig()
        self._telemetry = telemetry = telemetry or Telemetry()
        # Instances parked here (history diverged, or their version is not deployed).
        self.parked: set[str] = set()
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
        self._applier = Applier(
            backend,
            registry,
            self._cache,
            serde=serde,
            clock=clock,
            intake=CommandIntake(
                serde=serde,
                codec=codec,
                clock=clock,
                partition=backend.partition,
                partitions=backend.partitions,
                max_payload_bytes=config.max_payload_bytes,
            ),
            telemetry=telemetry,
        )
        self.reads = self._applier.reads
        # Fires this partition's timer service appended: read back without decoding.
        self.own_fires = self._applier.own_fires
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
        self._applying = 0  # step outcomes in the batch being applied and committed
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._fetch: asyncio.Task[list[LogEntry]] | None = None
        self._source = backend.source(COMMANDS)
        self._committed = asyncio.Event()
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
        batch = self._applier.resumption()
        await self._commit(batch)
        touched = batch.touched
        if touched:
            log.info(
                "resumed %d unfinished instances", len(touched), extra={"partition": self.partition}
            )
        parked = sum(1 for rt in touched.values() if rt.state.parked)
        if parked:
            log.warning(
                "%d instances parked (history diverged from the code, their version is not "
                "deployed here, or this engine's payload codec cannot read them); stepstream "
                "list --diverged lists the diverged ones, stepstream status ID says why one "
                "is parked",
                parked,
                extra={"partition": self.partition},
            )

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
                "%d step attempts still running after the drain timeout "
                "(STEPSTREAM_DRAIN_TIMEOUT_S); the next owner records them as lost attempts",
                left,
                extra={"partition": self.partition},
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

    @property
    def outcomes_pending(self) -> int:
        """Step outcomes delivered and not committed yet (what a test environment waits
        for: an ephemeral step's records are written only with its outcome)."""
        return len(self._outcomes) + self._applying

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
                log.warning("stopped processing: %s", exc, extra={"partition": self.partition})
                self._hooks.halt()
                return
            except Unstorable as exc:
                # The same batch would fail the same way for ever: set the instance
                # apart, and go on from the last commit without it at once.
                log.error(
                    "%s; its inputs are refused (dead letters) from now on, and the "
                    "partition goes on from the last commit without them",
                    exc,
                    exc_info=exc.__cause__ is not None,
                    extra={"partition": self.partition, "instance_id": exc.instance_id},
                )
                self._applier.quarantine(exc.instance_id, exc.reason)
                self._telemetry.quarantined(self.partition)
                reload = True
            except Exception as exc:
                # A commit failed (or a bug escaped). Memory may be ahead of what is
                # durable: forget it, go back to the last commit and resume from there;
                # a reload that fails is tried again, never skipped.
                log.log(
                    logging.ERROR,
                    "%s failed; reloading from the last commit in %.1f s%s",
                    "reload" if reload else "processing",
                    backoff,
                    f": {exc}" if isinstance(exc, StepstreamError) else "",
                    exc_info=not isinstance(exc, StepstreamError),
                    extra={"partition": self.partition},
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
                    self._applying = len(outcomes)
                    try:
                        await self._process(entries, outcomes, fires)
                    finally:
                        self._applying = 0
                if self._sweeper.due(loop.time()):
                    forgotten = await self._sweeper.sweep()
                    if forgotten and self._on_forgotten is not None:
                        self._on_forgotten(forgotten)
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
        batch = self._applier.batch(entries, outcomes, fires)
        self._outcomes.extend(batch.outcomes_again)
        await self._commit(batch)
        self._fires_in_batch = []
        if batch.fires_again:
            self.fire(batch.fires_again)
        redrive = batch.poisoned_seen | batch.redrive
        if redrive:
            await self._commit(self._applier.recovery(sorted(redrive)))

    # ---- persistence ----------------------------------------------------------------

    async def _commit(self, batch: Batch) -> None:
        """Make what the batch decided durable, then act on it: count it, launch the
        attempts, wake the waiters."""
        out, touched = batch.out, batch.touched
        persist(batch, self._serde, self.partition)
        await self._hooks.write_ahead(out, touched)  # hooks
        began = time.perf_counter()
        await self.backend.commit(batch.commit)
        self._telemetry.committed(
            self.partition,
            out.history,
            touched,
            records=len(batch.commit.appends),
            seconds=time.perf_counter() - began,
            outcomes=batch.applied_outcomes,
            began_ns=batch.began_ns,
        )
        self._after_commit(batch)

    def _after_commit(self, batch: Batch) -> None:
        out, touched = batch.out, batch.touched
        for instance_id, key, attempt in out.cancels:
            self._executor.cancel(instance_id, key, attempt)
        now_ms = self._clock.now_ms()
        if out.launches:
            self._telemetry.steps_launched(out.launches, batch.began_ms, now_ms)
            launch_step, deliver, partition = self._executor.launch, self.deliver, self.partition
            for launch in out.launches:
                launch_step(launch, deliver, partition)
        parked = self.parked
        for instance_id, runtime in touched.items():
            state = runtime.state
            if state.parked and not state.status.finished:
                parked.add(instance_id)
            elif parked:
                parked.discard(instance_id)
            if state.status.finished and not runtime.busy:
                self._cache.drop(instance_id)
        horizon = now_ms + self._config.evict_sleepers_after_s * 1000
        for instance_id in long_sleepers(batch, horizon):
            self._cache.drop(instance_id)
        self._cache.evict()
        self._hooks.launch()  # hooks: the records are durable now
        states = [rt.state for rt in touched.values()]
        self._on_commit(Committed(states, batch.settled, out.replies))
        self._committed.set()
