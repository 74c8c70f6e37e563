"""A host of partitions: the processors and timer services of the partitions this
process owns, the step executor they share, reads routed to the owning partition, and
waiters that are woken by commits (never by polling)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, replace

from stepstream.consumers.heap_trim import HeapTrim
from stepstream.consumers.partition import Committed, PartitionProcessor, ProcessorConfig
from stepstream.consumers.steps import StepExecutor
from stepstream.consumers.telemetry import Telemetry
from stepstream.consumers.timers import TimerService
from stepstream.engine.api.outbox import Outbox
from stepstream.engine.api.workflow import Registry, WorkflowDefinition
from stepstream.engine.errors import InstanceFinished, UnknownInstance
from stepstream.engine.reads.listing import (
    InstancePage,
    ListQuery,
    Overview,
    merge_overviews,
    merge_pages,
)
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.seams import Clock, PartitionBackend
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.engine.wire.records import HistoryRecord, Payload
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.settle import settled_key
from stepstream.engine.wire.topics import COMMANDS, partition_for

log = logging.getLogger("stepstream.host")

# How far an overview got: since when it counts finishes, and where each partition not
# yet done goes on (None: at its beginning).
OverviewProgress = tuple[int, dict[int, bytes | None]]


# Commands settled lately are kept for publishers that ask how theirs ended once it is
# durable: a kafka:// client asks the owner right after the broker acknowledged it (and
# gives up after its command timeout, 5 s by default), so the commit may come first. An
# applied command can also be found later on its instance (``settled_before``); a refused
# one (why it was dead-lettered) only here, and without it the client would report a
# refused command as accepted. So they are kept for RECENT_SETTLED_S, far beyond any
# client's wait, and at most RECENT_SETTLED of them, enough for that long at a worker's
# command rate (about 10,000/s): a burst leaves no more behind than that.
RECENT_SETTLED = 50_000
RECENT_SETTLED_S = 120.0


@dataclass(frozen=True, slots=True)
class PartitionGauges:
    partition: int
    timers_pending: int
    timers_held: int  # the soonest due, in memory; the rest are in the index only
    cached_instances: int
    parked_instances: int
    lag: int  # commands appended to the partition and not yet applied


@dataclass(slots=True)
class _Owned:
    processor: PartitionProcessor
    timers: TimerService


class PartitionHost:
    def __init__(
        self,
        registry: Registry,
        *,
        partitions: int,
        serde: RecordSerde,
        codec: PayloadCodec,
        clock: Clock,
        max_payload_bytes: int,
        config: ProcessorConfig | None = None,
        outbox: Outbox | None = None,
    ) -> None:
        """``outbox``: what ``ctx.publish`` produces with (None: publishing fails, with
        an error saying how to configure it)."""
        self.registry = registry
        self.partitions = partitions
        self.serde = serde
        self.codec = codec
        self.clock = clock
        self.executor = StepExecutor(codec, max_payload_bytes=max_payload_bytes, outbox=outbox)
        self._config = replace(config or ProcessorConfig(), max_payload_bytes=max_payload_bytes)
        self._owned: dict[int, _Owned] = {}
        self.telemetry = Telemetry()
        # What retention forgets is freed, and given back to the system (glibc).
        self.heap_trim = HeapTrim.from_env(os.environ)
        self._settled: dict[str, asyncio.Future[str | None]] = {}
        # How many callers of ``settled`` have not called ``forget`` yet, per command:
        # two waits on one command share its future, and the first to give up must not
        # take it from the other.
        self._settled_waiters: dict[str, int] = {}
        # Commands settled lately (see RECENT_SETTLED): ``settled_key`` -> when, in the
        # clock's ms, oldest first; and, for the few refused, why. No tuple per command:
        # at the bound of 50,000 the map holds 8 MB with their ids rather than 11. The
        # futures above are keyed the same way: a command id is unique on its instance
        # only (two instances may be sent events with one event id).
        self._recent: OrderedDict[str, int] = OrderedDict()
        self._refused: dict[str, str] = {}
        # Waiters per message (``settled_key``) and per instance, in dicts used as
        # ordered sets: removing one is O(1), however many wait for the same one.
        self._replies: defaultdict[str, dict[asyncio.Future[Payload], None]] = defaultdict(dict)
        self._finished: defaultdict[str, dict[asyncio.Future[InstanceState], None]] = defaultdict(
            dict
        )
        # Waiters for a partition's commands to be applied up to an offset: partition ->
        # waiter -> the offset it waits past.
        self._consumed: defaultdict[int, dict[asyncio.Future[None], int]] = defaultdict(dict)

    # ---- ownership ------------------------------------------------------------------

    async def assign(self, backend: PartitionBackend) -> None:
        processor = PartitionProcessor(
            backend,
            self.registry,
            serde=self.serde,
            codec=self.codec,
            clock=self.clock,
            executor=self.executor,
            on_commit=self._committed,
            on_forgotten=self.heap_trim.forgotten,
            config=self._config,
            telemetry=self.telemetry,
        )
        timers = TimerService(
            backend,
            serde=self.serde,
            clock=self.clock,
            own_fires=processor.own_fires,
            direct=processor,
        )
        await processor.start()
        await timers.start()
        self._owned[backend.partition] = _Owned(processor, timers)

    async def drain(self, partitions: list[int]) -> None:
        """A graceful hand-over of ``partitions``: timers stop firing, and running step
        attempts finish and are recorded (within the drain timeout) while nothing new
        starts. The partitions stay owned, and committing, until ``revoke``."""
        draining = [self._owned[p] for p in partitions if p in self._owned]
        for owned in draining:
            await owned.timers.stop()
        await asyncio.gather(*(owned.processor.drain() for owned in draining))

    async def revoke(self, partition: int) -> None:
        owned = self._owned.pop(partition, None)
        if owned is not None:
            await owned.timers.stop()
            await owned.processor.stop()
            self.telemetry.partition_released(partition)

    async def close(self) -> None:
        await self.drain(list(self._owned))
        for partition in list(self._owned):
            await self.revoke(partition)
        self.heap_trim.close()
        self.executor.shutdown()

    @property
    def drain_timeout_s(self) -> float:
        return self._config.drain_timeout_s

    @property
    def owned(self) -> list[int]:
        return sorted(self._owned)

    @property
    def timers_pending(self) -> int:
        return sum(o.timers.pending for o in self._owned.values())

    def gauges(self) -> list[PartitionGauges]:
        """Per owned partition: what is pending now, for metrics read at scrape time."""
        out: list[PartitionGauges] = []
        for partition, owned in sorted(self._owned.items()):
            processor = owned.processor
            out.append(
                PartitionGauges(
                    partition=partition,
                    timers_pending=owned.timers.pending,
                    timers_held=owned.timers.held,
                    cached_instances=processor.cached,
                    parked_instances=len(processor.parked),
                    lag=processor.lag,
                )
            )
        return out

    def processor(self, partition: int) -> PartitionProcessor:
        """The processor of an owned partition (``KeyError`` if it is not owned here)."""
        return self._owned[partition].processor

    def owns(self, instance_id: str) -> bool:
        return partition_for(instance_id, self.partitions) in self._owned

    def _processor(self, instance_id: str) -> PartitionProcessor:
        partition = partition_for(instance_id, self.partitions)
        owned = self._owned.get(partition)
        if owned is None:
            raise LookupError(f"partition {partition} of instance {instance_id} is not owned here")
        return owned.processor

    # ---- waiters --------------------------------------------------------------------

    def _committed(self, committed: Committed) -> None:
        recent = self._recent
        refused = self._refused
        now_ms = self.clock.now_ms()
        for key, reason in committed.commands.items():
            recent[key] = now_ms
            recent.move_to_end(key)
            if reason is not None:
                refused[key] = reason
            elif refused:
                refused.pop(key, None)
            fut = self._settled.pop(key, None)
            self._settled_waiters.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(reason)
        self._expire_recent(now_ms)
        for state in committed.instances:
            if state.status.finished:
                for waiter in self._finished.pop(state.instance_id, ()):
                    if not waiter.done():
                        waiter.set_result(state)
        for key, answer in committed.replies.items():
            for asker in self._replies.pop(key, ()):
                if not asker.done():
                    asker.set_result(answer)
        for partition, waiters in self._consumed.items():  # empty but for reads-after-start
            owned = self._owned.get(partition)
            if owned is None:
                continue
            done = owned.processor.backend.committed_offset(COMMANDS)
            for consumed, offset in waiters.items():
                if offset < done and not consumed.done():
                    consumed.set_result(None)

    async def wait_consumed(self, instance_id: str, offset: int, timeout: float | None) -> None:
        """Until this owner has applied (or dead-lettered) the commands of the instance's
        partition up to ``offset``; ``TimeoutError`` after ``timeout`` seconds."""
        partition = partition_for(instance_id, self.partitions)
        backend = self._processor(instance_id).backend
        if backend.committed_offset(COMMANDS) > offset:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._consumed[partition]
        waiters[waiter] = offset
        try:
            async with asyncio.timeout(timeout):
                await waiter
        finally:
            waiters.pop(waiter, None)
            if not waiters:
                del self._consumed[partition]

    def _expire_recent(self, now_ms: int) -> None:
        recent = self._recent
        oldest = now_ms - int(RECENT_SETTLED_S * 1000)
        refused = self._refused
        while recent and (len(recent) > RECENT_SETTLED or next(iter(recent.values())) < oldest):
            key, _ = recent.popitem(last=False)
            if refused:
                refused.pop(key, None)

    @property
    def recent_settled(self) -> int:
        """How many settled commands this process keeps for publishers that ask."""
        return len(self._recent)

    def settled_recently(self, instance_id: str, command_id: str) -> tuple[bool, str | None]:
        """Whether this process settled the instance's ``command_id`` lately, and how."""
        return self._recently(settled_key(instance_id, command_id))

    def _recently(self, key: str) -> tuple[bool, str | None]:
        self._expire_recent(self.clock.now_ms())
        if key in self._recent:
            return True, self._refused.get(key)
        return False, None

    def settled(self, instance_id: str, command_id: str) -> asyncio.Future[str | None]:
        """Resolves once the instance's command is applied (None) or dead-lettered (the
        reason). Register before publishing the command."""
        key = settled_key(instance_id, command_id)
        fut = self._settled.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            found, reason = self._recently(key)
            if found:
                fut.set_result(reason)
                return fut
            self._settled[key] = fut
        self._settled_waiters[key] = self._settled_waiters.get(key, 0) + 1
        return fut

    def forget(self, instance_id: str, command_id: str) -> None:
        """One caller of ``settled`` no longer waits; the last one drops the future."""
        key = settled_key(instance_id, command_id)
        left = self._settled_waiters.pop(key, 0) - 1
        if left > 0:
            self._settled_waiters[key] = left
        else:
            self._settled.pop(key, None)

    async def wait_reply(self, instance_id: str, message_id: str, timeout: float | None) -> Payload:
        """The instance's answer to the message ``message_id`` (``msg.complete``), once it
        is durable; ``TimeoutError`` after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Payload] = loop.create_future()
        key = settled_key(instance_id, message_id)
        self._replies[key][fut] = None
        # An instance that ends without answering never will: the asker is told at once.
        ended: asyncio.Future[InstanceState] = loop.create_future()
        self._finished[instance_id][ended] = None
        try:
            # Read after registering, so a commit in between cannot be missed.
            reads = self._processor(instance_id).reads
            answer = reads.reply(instance_id, message_id)
            if answer is not None:
                return answer
            if not self.finished(instance_id):  # UnknownInstance if there is none
                async with asyncio.timeout(timeout):  # one wake-up, where wait_for takes two
                    await asyncio.wait((fut, ended), return_when=asyncio.FIRST_COMPLETED)
                if fut.done():
                    return fut.result()
                # Its answer, if any, was in the commit that ended it: stored by now.
                answer = reads.reply(instance_id, message_id)
                if answer is not None:
                    return answer
            status = self.read_state(instance_id, entries=False).status.value
            raise InstanceFinished(
                f"instance {instance_id} ended ({status}) without answering message "
                f"{message_id}: its code did not call msg.complete() for it before it ended; "
                f"see `stepstream history {instance_id}`"
            )
        finally:
            waiters = self._replies.get(key)
            if waiters is not None and waiters.pop(fut, 0) is None and not waiters:
                del self._replies[key]
            waiting = self._finished.get(instance_id)
            if waiting is not None and waiting.pop(ended, 0) is None and not waiting:
                del self._finished[instance_id]

    async def wait_finished(self, instance_id: str, timeout: float | None) -> InstanceState:
        fut: asyncio.Future[InstanceState] = asyncio.get_running_loop().create_future()
        self._finished[instance_id][fut] = None
        try:
            # Read after registering, so a commit in between cannot be missed.
            if self.finished(instance_id):
                return self.read_state(instance_id, entries=False)
            async with asyncio.timeout(timeout):  # one wake-up, where wait_for takes two
                return await fut
        finally:
            waiters = self._finished.get(instance_id)
            if waiters is not None and waiters.pop(fut, 0) is None and not waiters:
                del self._finished[instance_id]

    # ---- reads ----------------------------------------------------------------------

    def resolve(self, workflow: str, version: str | None = None) -> WorkflowDefinition:
        return self.registry.resolve(workflow, version)

    def finished(self, instance_id: str) -> bool:
        """Whether the instance finished; raises UnknownInstance if there is none."""
        finished = self._processor(instance_id).reads.finished(instance_id)
        if finished is None:
            raise _unknown(instance_id)
        return finished

    def settled_before(self, instance_id: str, command_id: str) -> tuple[bool, str | None]:
        return self._processor(instance_id).reads.settled_before(instance_id, command_id)

    def read_state(self, instance_id: str, *, entries: bool = True) -> InstanceState:
        state = self._processor(instance_id).reads.read_state(instance_id, entries=entries)
        if state is None:
            raise _unknown(instance_id)
        return state

    def read_history(self, instance_id: str) -> list[HistoryRecord]:
        self.finished(instance_id)
        return self._processor(instance_id).reads.read_history(instance_id)

    def list_instances(self) -> list[InstanceState]:
        found: list[InstanceState] = []
        for owned in self._owned.values():
            found.extend(owned.processor.reads.list_instances())
        return found

    def list_page(self, query: ListQuery, budget: int) -> InstancePage:
        """A page of ``query`` over the owned partitions, each looking at no more than
        ``budget`` instances (so the page may be short: go on from its cursor)."""
        if query.by_id:
            pages = [o.processor.reads.list_page(query, budget) for o in self._owned.values()]
        else:  # from each partition's index by created time (consumers.created_listing)
            pages = [o.processor.reads.list_by_created(query) for o in self._owned.values()]
        return merge_pages(pages, query.limit, query)

    def overview_slice(
        self, progress: OverviewProgress | None, budget: int
    ) -> tuple[Overview, OverviewProgress | None]:
        """Part of the overview of the owned partitions (each looks at no more than
        ``budget`` keys) and where to go on (None: done); start with None. A partition
        that moved away meanwhile is left to its new owner."""
        if progress is None:
            progress = (self.clock.now_ms() - 3600_000, dict.fromkeys(self._owned))
        since, starts = progress
        parts = []
        left: dict[int, bytes | None] = {}
        for partition, start in starts.items():
            owned = self._owned.get(partition)
            if owned is None:
                continue
            part, next_start = owned.processor.reads.overview_slice(since, start, budget)
            parts.append(part)
            if next_start is not None:
                left[partition] = next_start
        return merge_overviews(parts), (since, left) if left else None


def _unknown(instance_id: str) -> UnknownInstance:
    return UnknownInstance(
        f"no instance {instance_id!r}; check the id, or start it first (a finished instance "
        "is forgotten once STEPSTREAM_RETENTION_S, 30 days by default, has passed)"
    )
