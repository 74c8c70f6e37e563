"""The partitions the consumer group gives this worker: for each one assigned, open its
RocksDB, restore and fence it, and hand it to the ``PartitionHost`` (processor and timer
service); for each one revoked, stop them and close the RocksDB.

A partition directory RocksDB finds damaged while it is being taken over is moved aside
and the state rebuilt from the topics there and then. Damage found later, by a read while
the partition runs, stops the worker (nothing read from that state can be trusted, and
its processor cannot be restarted on a fresh state without the group handing the
partition over again); the directory is marked, and moved aside when it is next opened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from stepstream.consumers.host import PartitionHost
from stepstream.consumers.kafka.db import (
    PartitionDB,
    StateCorrupted,
    mark_damaged,
    needs_quarantine,
    quarantine,
)
from stepstream.consumers.kafka.group import GroupConsumer
from stepstream.consumers.kafka.group_assignment import KINDS
from stepstream.consumers.kafka.group_offsets import Position
from stepstream.consumers.kafka.logins import LoginWatch
from stepstream.consumers.kafka.partition import KafkaPartition
from stepstream.consumers.kafka.producer import LogProducer
from stepstream.consumers.kafka.restore import Headers, HistoryReader, restore_partition
from stepstream.consumers.kafka.snapshots import DEFAULT_SNAPSHOT_EVERY, SnapshotReader, Snapshotter
from stepstream.consumers.kafka.source import KafkaSource
from stepstream.consumers.kafka.state_dir import StateDir
from stepstream.consumers.rocks_memory import RocksMemory
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.errors import UndecodableRecord
from stepstream.engine.seams import Clock
from stepstream.engine.wire.records import PartitionFenced
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.topics import SNAPSHOTS, TopicNames

log = logging.getLogger("stepstream.kafka.runner")


def _open_sound(path: str, partition: int, partitions: int, memory: RocksMemory) -> PartitionDB:
    """Open the partition's state; one RocksDB finds damaged (or that was marked damaged
    while it ran) is moved aside first, and an empty one opened in its place."""
    reason = needs_quarantine(path)
    if reason is None:
        try:
            return PartitionDB.open(path, partition, partitions, memory)
        except StateCorrupted as exc:
            reason = str(exc)
    quarantine(path, reason, partition)
    return PartitionDB.open(path, partition, partitions, memory)


OnOwned = Callable[[dict[int, int]], Coroutine[Any, Any, None]]


class KafkaRunner:
    def __init__(
        self,
        settings: KafkaSettings,
        host: PartitionHost,
        *,
        state_dir: StateDir,
        producer: LogProducer,
        serde: RecordSerde,
        clock: Clock,
        on_owned: OnOwned,
        on_fatal: Callable[[BaseException], None],
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        logins: LoginWatch | None = None,
    ) -> None:
        self._settings = settings
        self._logins = logins
        self._host = host
        self._state_dir = state_dir
        self._producer = producer
        self._serde = serde
        self._clock = clock
        self._on_owned = on_owned
        self._on_fatal = on_fatal
        self._topics = TopicNames(settings.prefix)
        self._owned: dict[int, KafkaPartition] = {}
        self._reader: HistoryReader | None = None
        self._snapshot_reader: SnapshotReader | None = None
        self._gap_reader: HistoryReader | None = None
        self._gap_lock = asyncio.Lock()
        self._snapshot_every = snapshot_every
        # Partitions being taken over (restored), one at a time, in the order assigned,
        # and the one whose take has begun.
        self._taking: dict[int, asyncio.Task[None]] = {}
        self._take_lock = asyncio.Lock()
        self._taking_now: int | None = None
        self._group = GroupConsumer(
            settings,
            on_assign=self._assign,
            on_revoke=self._revoke,
            on_lost=self._lose,
            on_fatal=on_fatal,
            client_id=f"stepstream-worker-{state_dir.worker_id[:8]}",
            logins=logins,
        )
        self.rebalances = 0
        self._restoring: set[int] = set()  # assigned, not restored yet
        self._joined = False
        self._lost = False

    @property
    def owned(self) -> dict[int, int]:
        """Partition -> the epoch this worker owns it with."""
        return {p: backend.epoch for p, backend in sorted(self._owned.items())}

    async def start(self) -> None:
        quiet = self._logins is not None
        self._reader = await asyncio.to_thread(HistoryReader, self._settings, quiet=quiet)
        snapshots = await asyncio.to_thread(HistoryReader, self._settings, SNAPSHOTS, quiet=quiet)
        self._snapshot_reader = SnapshotReader(snapshots, self._serde)
        self._gap_reader = await asyncio.to_thread(HistoryReader, self._settings, quiet=quiet)
        self._group.start()

    async def stop(self) -> None:
        """Leave the group: what is still owned is revoked first."""
        await self._group.stop()
        if self._owned or self._taking:  # the poll thread died before it could revoke
            await self._revoke(sorted({*self._owned, *self._taking}))
        if self._reader is not None:
            await asyncio.to_thread(self._reader.close)
            self._reader = None
        if self._snapshot_reader is not None:
            await asyncio.to_thread(self._snapshot_reader.close)
            self._snapshot_reader = None
        if self._gap_reader is not None:
            async with self._gap_lock:  # a shielded read may still be using it
                await asyncio.to_thread(self._gap_reader.close)
                self._gap_reader = None

    async def _assign(self, partitions: list[int], committed: dict[Position, int | None]) -> None:
        """Take the partitions over one by one; each is fetched and announced as soon as
        it is restored, while the partitions this worker already owns run on."""
        self.rebalances += 1
        self._joined, self._lost = True, False
        if not partitions:
            await self._on_owned(self.owned)  # a live member, owning what it owns
            return
        self._restoring.update(partitions)
        tasks = []
        for partition in partitions:
            task = asyncio.get_running_loop().create_task(self._take_one(partition, committed))
            self._taking[partition] = task
            tasks.append(task)
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            # A take cancelled before it began was revoked meanwhile; any other failure
            # is the worker's.
            if isinstance(outcome, BaseException) and not isinstance(
                outcome, asyncio.CancelledError
            ):
                raise outcome

    async def _take_one(self, partition: int, committed: dict[Position, int | None]) -> None:
        try:
            async with self._take_lock:
                self._taking_now = partition
                began = time.monotonic()
                backend = await self._take(partition, committed)
                starts = {kind: backend.source(kind).position for kind in KINDS}
                self._group.fetch(partition, starts)
                log.info(
                    "took the partition in %.3f s",
                    time.monotonic() - began,
                    extra={"partition": partition, "epoch": backend.epoch},
                )
                await self._on_owned(self.owned)
        finally:
            self._restoring.discard(partition)
            if self._taking_now == partition:
                self._taking_now = None
            if self._taking.get(partition) is asyncio.current_task():
                del self._taking[partition]

    @property
    def ready(self) -> bool:
        """Joined the group, every assigned partition restored, none lost since."""
        return self._joined and not self._restoring and not self._lost

    @property
    def unreachable_since(self) -> float | None:
        """Since when (epoch seconds) the group consumer has seen no broker up."""
        return self._group.unreachable_since

    async def _take(self, partition: int, committed: dict[Position, int | None]) -> KafkaPartition:
        """Open the partition's state, bring it up to the topics and start it. A state
        directory found damaged on the way (by RocksDB at open, or by a read during the
        restore or the processor's start) is moved aside and the partition taken again
        from the topics alone."""
        path = self._state_dir.partition_path(partition)
        for last_try in (False, True):
            db = await asyncio.to_thread(
                _open_sound, path, partition, self._host.partitions, self._state_dir.memory
            )
            try:
                backend = await self._start(db, partition, committed)
            except StateCorrupted as exc:
                self._group.detach(partition)
                db.close()
                if last_try:
                    raise
                await asyncio.to_thread(quarantine, path, str(exc), partition)
                continue
            except BaseException:
                self._group.detach(partition)
                db.close()
                raise
            # From here a damaged block a read runs into stops the worker.
            db.on_corrupt = self._corrupt_found
            self._owned[partition] = backend
            return backend
        raise AssertionError("unreachable")

    async def _start(
        self, db: PartitionDB, partition: int, committed: dict[Position, int | None]
    ) -> KafkaPartition:
        assert self._reader is not None
        began = time.perf_counter()
        db, restored = await restore_partition(
            db,
            partition,
            reader=self._reader,
            producer=self._producer,
            serde=self._serde,
            clock=self._clock,
            topics=self._topics,
            group_offsets={kind: committed.get((kind, partition)) for kind in KINDS},
            snapshots=self._snapshot_reader,
        )
        sources = {kind: KafkaSource(kind, partition, restored.starts[kind]) for kind in KINDS}
        for source in sources.values():
            self._group.attach(source)
        backend = KafkaPartition(
            db=db,
            partition=partition,
            partitions=self._host.partitions,
            epoch=restored.epoch,
            previous_epoch=restored.previous_epoch,
            sources=sources,
            producer=self._producer,
            topics=self._topics,
            consumed=self._group.consumed,
            on_failure=self._commit_failed,
            snapshots=Snapshotter(
                partition=partition,
                every=self._snapshot_every,
                producer=self._producer,
                serde=self._serde,
                clock=self._clock,
                topics=self._topics,
                epoch=restored.epoch,
            ),
            fences_between=self._fences_between,
            high_watermark=self._group.high_watermark,
        )
        await self._host.assign(backend)
        self._host.telemetry.restore_seconds[partition] = time.perf_counter() - began
        return backend

    async def _fences_between(self, partition: int, start: int, stop: int) -> int:
        """The highest epoch of a fence in history[start:stop] (0 if none): what a gap
        in a commit's offsets holds."""
        found = 0

        def note(_offset: int, value: bytes, _headers: Headers) -> None:
            nonlocal found
            try:
                record = self._serde.decode(value)
            except UndecodableRecord:
                return
            if isinstance(record, PartitionFenced):
                found = max(found, record.epoch)

        async def read() -> None:
            async with self._gap_lock:
                assert self._gap_reader is not None
                await asyncio.to_thread(self._gap_reader.read, partition, start, stop, note)

        # Shielded: a cancelled commit must not release the reader while its thread
        # still uses it.
        await asyncio.shield(asyncio.get_running_loop().create_task(read()))
        return found

    def _corrupt_found(self, exc: StateCorrupted) -> None:
        log.error(
            "%s, found while running: stopping this worker; started again it moves the "
            "directory aside and rebuilds the partition from the topics",
            exc,
        )
        try:
            mark_damaged(exc.path, str(exc))
        except OSError as marking:
            log.error("could not mark %s as damaged: %s", exc.path, marking)
        self._on_fatal(exc)

    def _commit_failed(self, exc: BaseException) -> None:
        log.error("a commit failed; stopping this worker so the partitions are restored: %s", exc)
        self._on_fatal(exc)

    async def _lose(self, partitions: list[int]) -> None:
        self._lost = True  # not ready until the group assigns partitions again
        await self._revoke(partitions, drain=False)

    async def _revoke(self, partitions: list[int], *, drain: bool = True) -> None:
        # A take not begun yet is dropped: fencing a partition that is no longer ours
        # would depose its new owner. One under way is finished first (its fence is on
        # the topic, its state half written) and given up like any other.
        taking = [t for p in partitions if (t := self._taking.get(p)) is not None]
        for partition in partitions:
            if partition in self._taking and partition != self._taking_now:
                self._taking[partition].cancel()
        await asyncio.gather(*taking, return_exceptions=True)
        if drain:
            # Still the owner until this returns (the group waits for it): running step
            # attempts finish and are recorded here rather than lost to the next owner,
            # and a snapshot being written gets the same time to complete.
            owned = [p for p in partitions if p in self._owned]
            snapshots = [s for p in owned if (s := self._owned[p].snapshots) is not None]
            timeout = self._host.drain_timeout_s
            await asyncio.gather(self._host.drain(owned), *(s.finish(timeout) for s in snapshots))
        for partition in partitions:
            backend = self._owned.pop(partition, None)
            if backend is None:
                continue
            backend.revoke()  # no commit from here on, so no new snapshot either
            self._group.detach(partition)
            await self._host.revoke(partition)
            if backend.snapshots is not None:
                await backend.snapshots.stop()  # its iterator must go before the db
            backend.db.close()
        await self._on_owned(self.owned)
