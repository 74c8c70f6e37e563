"""The timer service of one partition: consumes the timers topic into a durable index
ordered by fire time, and fires each timer when it is due. A timer fires at or after its
time, never before; firing twice is harmless because the instance only accepts a fire for
a timer it is still waiting on.

A fire reaches the instance one of two ways. When the partition's processor has applied
every command up to the end of the commands topic as it last heard it, the ``TimerFired``
is handed to the processor directly and applied in its next batch, whose commit also
takes the timer out of the index. Otherwise (the processor is behind: a backlog, a
restart) the fire is appended to the commands topic behind the commands already there.
Either way a fire comes after every command acknowledged before the processor last
heard the topic's end; only a command sent in the last moments before a fire (one fetch
of the topic: a few milliseconds) races with it, as it would race with the timer itself.
The round trip spared is a record produced, stored, fetched back and decoded per fire.

Only the timers due soonest are held in memory (a window of at most ``window`` timers);
the rest live in the index alone and are read back in due order, a chunk at a time,
as the window drains. Memory and the collector's work stay the same whether a hundred
or ten million timers are pending."""

from __future__ import annotations

import asyncio
import heapq
import logging
from typing import Protocol

from stepstream.consumers import state_keys as keys
from stepstream.consumers.dead_letters import dead_letter
from stepstream.engine.errors import UndecodableRecord
from stepstream.engine.replay.ids import TIMER_FIRE_PREFIX
from stepstream.engine.seams import (
    Append,
    Clock,
    CommitBatch,
    LogEntry,
    PartitionBackend,
    StateStore,
)
from stepstream.engine.wire.records import TimerCancelled, TimerFired, TimerScheduled
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.topics import COMMANDS, TIMERS

log = logging.getLogger("stepstream.timers")

# A due timer waits up to this long for its processor to catch up (apply the commands it
# has not applied yet) before its fire goes round the commands topic instead.
CATCH_UP_WAIT_S = 0.05
_CATCH_UP_POLL_S = 0.002

# Timers held in memory at most; past that the later half is dropped to the index alone.
WINDOW = 20_000
# Read back from the index when fewer than this are held, up to this many at a time: a
# read of this size costs a few milliseconds, so it barely delays a fire.
_REFILL = 2_000
_NEVER = 2**63 - 1


def index_entries(fire_at_ms: int, timer_id: str, instance_id: str) -> list[tuple[bytes, bytes]]:
    """The state keys that put one timer into the index (by fire time, and by id)."""
    return [
        (keys.timer(fire_at_ms, instance_id, timer_id), b""),
        (keys.timer_by_id(instance_id, timer_id), str(fire_at_ms).encode()),
    ]


def unindex(batch: CommitBatch, fire_at_ms: int, instance_id: str, timer_id: str) -> None:
    """Queue taking one timer out of the index (its fire or its cancel)."""
    batch.delete(keys.timer(fire_at_ms, instance_id, timer_id))
    batch.delete(keys.timer_by_id(instance_id, timer_id))


def _upgrade_legacy(store: StateStore, legacy: list[tuple[bytes, int, str, str]]) -> CommitBatch:
    """Rewrite index keys of the layout keyed by timer id alone into today's layout."""
    batch = CommitBatch()
    for key, fire_at, instance_id, timer_id in legacy:
        batch.delete(key)
        for new_key, value in index_entries(fire_at, timer_id, instance_id):
            batch.put(new_key, value)
    for key, _ in store.scan(keys.TIMER_BY_ID):
        if keys.legacy_timer_by_id(key):
            batch.delete(key)
    return batch


class OwnFires:
    """The ``TimerFired`` commands this partition's timer service appended, by their
    bytes. The partition's processor takes a record back when it reads those bytes from
    the log, rather than decoding and checking again what this process wrote itself
    (equal bytes decode to an equal record). Only the most recent ``limit`` are kept:
    a processor further behind than that decodes the older ones."""

    def __init__(self, limit: int = 50_000) -> None:
        self._limit = limit
        self._records: dict[bytes, TimerFired] = {}

    def __len__(self) -> int:
        return len(self._records)

    def add(self, value: bytes, record: TimerFired) -> None:
        records = self._records
        if len(records) >= self._limit:
            del records[next(iter(records))]
        records[value] = record

    def take(self, value: bytes) -> TimerFired | None:
        return self._records.pop(value, None)


class DirectFires(Protocol):
    """The partition's processor, as the timer service hands it due timers."""

    def caught_up(self) -> bool: ...

    def fire(self, fires: list[TimerFired]) -> None: ...


class TimerService:
    def __init__(
        self,
        backend: PartitionBackend,
        *,
        serde: RecordSerde,
        clock: Clock,
        max_batch: int = 1000,
        own_fires: OwnFires | None = None,
        direct: DirectFires | None = None,
        window: int = WINDOW,
    ) -> None:
        """``direct``: the partition's processor. Due timers go to it without the round
        trip through the commands topic whenever it has applied every command up to the
        end of the topic as last heard; otherwise they are appended to the topic.
        ``window``: timers held in memory at most (the soonest due)."""
        self.backend = backend
        self._own_fires = own_fires
        self._direct = direct
        self._serde = serde
        self._clock = clock
        self._max_batch = max_batch
        self._window = max(4, window)
        self._refill_size = min(_REFILL, self._window // 4)
        self._heap: list[tuple[int, str, str]] = []  # (fire_at_ms, instance_id, timer_id)
        # (instance_id, timer_id) -> fire_at_ms of the live schedules held in memory
        self._live: dict[tuple[str, str], int] = {}
        # Every indexed timer due before the horizon is in memory (or on its way out: fired,
        # its index keys not yet deleted); those due at or after it are in the index only,
        # ``_beyond`` of them. A timer popped to fire is never read back from the index:
        # the horizon never falls to its time again.
        self._horizon = _NEVER
        self._beyond = 0
        self._fired_upto = -1
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()
        # Checked by the loops as well as cancelling them: Python 3.11's wait_for drops a
        # cancellation that lands as the awaited event is set (a timer record arriving
        # during shutdown), and the loop would go on.
        self._stopping = False

    @property
    def pending(self) -> int:
        return len(self._live) + self._beyond

    @property
    def held(self) -> int:
        """Timers held in memory (the soonest due); the others are in the index only."""
        return len(self._live)

    def next_due_ms(self) -> int | None:
        """When the soonest pending timer is due, or at the earliest, if none is held: the
        horizon (the first not held is due then or later). Walks what is held."""
        soonest = min(self._live.values(), default=None)
        if soonest is None and self._horizon != _NEVER:
            return self._horizon
        return soonest

    async def start(self) -> None:
        """Count the index, then hold the soonest half window of it."""
        legacy: list[tuple[bytes, int, str, str]] = []
        for key, value in self.backend.store.scan(keys.TIMER):
            old = keys.legacy_timer(key, value)
            if old is not None:
                legacy.append((key, *old))
            self._beyond += 1
        if legacy:
            await self.backend.commit(_upgrade_legacy(self.backend.store, legacy))
        if self._beyond:
            self._horizon = 0
            self._refill(self._window // 2)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._consume()), loop.create_task(self._fire())]

    async def stop(self) -> None:
        self._stopping = True
        self._changed.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    def _push(self, fire_at: int, instance_id: str, timer_id: str) -> None:
        self._live[instance_id, timer_id] = fire_at
        heapq.heappush(self._heap, (fire_at, instance_id, timer_id))

    def _hold(self, fire_at: int, instance_id: str, timer_id: str) -> None:
        """A newly indexed timer: held in memory if due before the horizon."""
        if fire_at < self._horizon:
            self._push(fire_at, instance_id, timer_id)
        else:
            self._beyond += 1

    def _trim(self) -> None:
        """Past the window, keep the soonest half in memory and lower the horizon to the
        first timer let go (never to a time already fired: those keys may still be in
        the index until their fires are committed)."""
        if len(self._live) <= self._window:
            return
        live = self._live
        heap = sorted(e for e in self._heap if live.get((e[1], e[2])) == e[0])  # a heap too
        keep = self._window // 2
        horizon = max(heap[keep][0], self._fired_upto + 1)
        while keep < len(heap) and heap[keep][0] < horizon:
            keep += 1
        if keep == len(heap):
            return  # over half the window is overdue: nothing to let go yet
        for _, instance_id, timer_id in heap[keep:]:
            del live[instance_id, timer_id]
        self._beyond += len(heap) - keep
        del heap[keep:]
        self._heap = heap
        self._horizon = horizon  # lower: every timer held or fired was due before the old one

    def _refill(self, count: int) -> None:
        """Read the next ``count`` timers in due order back from the index, whole
        milliseconds at a time, and raise the horizon past them."""
        got = 0
        last = -1
        for key, _ in self.backend.store.scan(keys.TIMER, keys.timer_prefix(self._horizon)):
            fire_at, instance_id, timer_id = keys.split_timer(key)
            if got >= count and fire_at != last:
                self._horizon = fire_at
                return
            self._push(fire_at, instance_id, timer_id)
            self._beyond = max(0, self._beyond - 1)
            got += 1
            last = fire_at
        self._horizon = _NEVER
        self._beyond = 0  # everything indexed is held again

    async def _consume(self) -> None:
        source = self.backend.source(TIMERS)
        while not self._stopping:
            entries = await source.fetch(self._max_batch, 1.0)
            if entries:
                async with self._lock:
                    await self._index(entries)
                self._changed.set()

    async def _index(self, entries: list[LogEntry]) -> None:
        batch = CommitBatch()
        staged: dict[tuple[str, str], int | None] = {}
        for entry in entries:
            try:
                record = self._serde.decode(entry.value)
            except UndecodableRecord as exc:
                batch.appends.append(self._dead_letter(entry, f"undecodable record: {exc}"))
                continue
            if isinstance(record, TimerScheduled):
                old = self._forget(record.instance_id, record.timer_id, staged)
                if old is not None:
                    batch.delete(keys.timer(old, record.instance_id, record.timer_id))
                for key, value in index_entries(
                    record.fire_at_ms, record.timer_id, record.instance_id
                ):
                    batch.put(key, value)
                self._hold(record.fire_at_ms, record.instance_id, record.timer_id)
                staged[record.instance_id, record.timer_id] = record.fire_at_ms
            elif not isinstance(record, TimerCancelled):
                batch.appends.append(
                    self._dead_letter(entry, f"{record.type} is not a timer record")
                )
            else:
                fire_at = self._forget(record.instance_id, record.timer_id, staged)
                if fire_at is not None:
                    unindex(batch, fire_at, record.instance_id, record.timer_id)
                staged[record.instance_id, record.timer_id] = None
        batch.offsets[TIMERS] = entries[-1].offset + 1
        self._trim()
        await self.backend.commit(batch)

    def _forget(
        self, instance_id: str, timer_id: str, staged: dict[tuple[str, str], int | None]
    ) -> int | None:
        """Take a timer's live schedule out of the count (it is cancelled or scheduled
        anew) and give its time, or None if it has none: fired, cancelled, or never
        scheduled. ``staged``: what this batch has already indexed or taken out."""
        fire_at = self._live.pop((instance_id, timer_id), None)
        if fire_at is not None:
            return fire_at
        if self._horizon == _NEVER:
            return None  # every indexed timer is held
        if (instance_id, timer_id) in staged:
            fire_at = staged[instance_id, timer_id]
        else:
            stored = self.backend.store.get(keys.timer_by_id(instance_id, timer_id))
            fire_at = None if stored is None else int(stored)
        # Due before the horizon yet not held: fired, its keys not yet deleted.
        if fire_at is None or fire_at < self._horizon:
            return None
        self._beyond = max(0, self._beyond - 1)
        return fire_at

    def _dead_letter(self, entry: LogEntry, reason: str) -> Append:
        return dead_letter(
            entry, reason, serde=self._serde, backend=self.backend, clock=self._clock
        )

    async def _fire(self) -> None:
        while not self._stopping:
            self._changed.clear()
            now = self._clock.now_ms()
            heap = self._heap
            while heap and self._live.get((heap[0][1], heap[0][2])) != heap[0][0]:
                heapq.heappop(heap)  # cancelled or rescheduled
            if self._horizon != _NEVER and len(self._live) < self._refill_size:
                async with self._lock:
                    self._refill(self._refill_size)
                heap = self._heap
                continue
            if heap and heap[0][0] <= now:
                direct = await self._caught_up()
                async with self._lock:
                    await self._fire_due(self._clock.now_ms(), direct=direct)
                continue
            if heap:
                await self._sleep_or_change(heap[0][0])
            else:
                await self._changed.wait()

    async def _sleep_or_change(self, until_ms: int) -> None:
        """Until the next timer is due, as the clock tells (a virtual clock wakes its
        sleepers when a test moves it on), or until timer records arrive."""
        sleeping = asyncio.ensure_future(self._sleep_until(until_ms))
        changed = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait((sleeping, changed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeping.cancel()
            changed.cancel()

    async def _sleep_until(self, until_ms: int) -> None:
        # The delay is taken when the sleep begins: a clock moved on in between (a test's
        # virtual clock) must not push the wake-up later.
        await self._clock.sleep((until_ms - self._clock.now_ms()) / 1000)

    async def _caught_up(self) -> bool:
        """Whether the processor takes fires directly: it has caught up, or does within
        ``CATCH_UP_WAIT_S`` (a command it is applying, a fetch on its way). A processor
        further behind than that gets its fires through the commands topic."""
        direct = self._direct
        if direct is None:
            return False
        if direct.caught_up():
            return True
        loop = asyncio.get_running_loop()  # real time: what it waits for is work done
        deadline = loop.time() + CATCH_UP_WAIT_S
        while loop.time() < deadline and not self._stopping:
            await asyncio.sleep(_CATCH_UP_POLL_S)
            if direct.caught_up():
                return True
        return False

    async def _fire_due(self, now: int, *, direct: bool = False) -> None:
        batch = CommitBatch()
        heap = self._heap
        own = self._own_fires
        handed: list[TimerFired] | None = [] if direct else None
        fired = 0
        while heap and heap[0][0] <= now and fired < self._max_batch:
            fire_at, instance_id, timer_id = heapq.heappop(heap)
            if self._live.get((instance_id, timer_id)) != fire_at:
                continue
            del self._live[instance_id, timer_id]
            if fire_at > self._fired_upto:
                self._fired_upto = fire_at
            command = TimerFired(
                instance_id=instance_id,
                time_ms=now,
                command_id=f"{TIMER_FIRE_PREFIX}{timer_id}",
                epoch=self.backend.epoch,
                timer_id=timer_id,
                fire_at_ms=fire_at,
            )
            fired += 1
            if handed is not None:
                handed.append(command)  # its index keys go with the processor's commit
                continue
            value = self._serde.encode(command)
            if own is not None:
                own.add(value, command)
            batch.appends.append(
                Append(COMMANDS, instance_id.encode(), value, self.backend.partition)
            )
            unindex(batch, fire_at, instance_id, timer_id)
        if handed and self._direct is not None:
            self._direct.fire(handed)
            await asyncio.sleep(0)  # the processor's turn: nothing here awaited
        if batch:
            await self.backend.commit(batch)
