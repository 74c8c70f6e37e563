"""One owned partition of the Kafka backend, as the engine's ``PartitionBackend`` seam.

Its state is the partition's RocksDB; its sources are what the group consumer fetches
for it; a commit produces the batch's records (history, timers, dead letters, fired
timers) and waits for all of their acknowledgements, then writes the state changes with
the offsets they cover in one RocksDB batch, then lets the group commit those offsets.
Kafka transactions are not used: a crash between the produce and the write leaves
records the state does not cover yet, which the next restore folds in. A commit that fails
any other way (Kafka refused a record, the disk refused the write) may have produced part
of the batch: the live state can no longer be trusted to match the history, so the
failure is fatal for the worker (``on_failure``), and the next owner restores.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable

from stepstream.consumers.kafka import keys
from stepstream.consumers.kafka.db import PartitionDB
from stepstream.consumers.kafka.producer import LogProducer, OutRecord
from stepstream.consumers.kafka.snapshots import Snapshotter
from stepstream.consumers.kafka.source import KafkaSource
from stepstream.engine.seams import CommitBatch, PartitionLost
from stepstream.engine.wire.topics import COMMANDS, DEAD_LETTERS, HISTORY, TopicNames, partition_for

Consumed = Callable[[str, int, int], None]
# (partition, start, stop) -> the highest epoch of a fence in history[start:stop], or 0.
FencesBetween = Callable[[int, int, int], Awaitable[int]]


class PartitionRevoked(PartitionLost):
    """A commit on a partition this worker no longer owns."""


class PartitionFenced(PartitionRevoked):
    """A commit found that a newer owner fenced the partition."""


class KafkaPartition:
    def __init__(
        self,
        *,
        db: PartitionDB,
        partition: int,
        partitions: int,
        epoch: int,
        previous_epoch: int = 0,
        sources: dict[str, KafkaSource],
        producer: LogProducer,
        topics: TopicNames,
        consumed: Consumed,
        on_failure: Callable[[BaseException], None],
        snapshots: Snapshotter | None = None,
        fences_between: FencesBetween | None = None,
        high_watermark: Callable[[str, int], int | None] | None = None,
    ) -> None:
        self.partition = partition
        self.partitions = partitions
        self.epoch = epoch
        self.previous_epoch = previous_epoch  # the local state's before its restore
        self.db = db
        self._sources = sources
        self._producer = producer
        self._topics = topics
        self._consumed = consumed
        self._on_failure = on_failure
        self._revoked = False
        self.snapshots = snapshots
        self._fences_between = fences_between
        self._high_watermark = high_watermark

    @property
    def store(self) -> PartitionDB:
        return self.db

    def source(self, kind: str) -> KafkaSource:
        try:
            return self._sources[kind]
        except KeyError:
            raise ValueError(
                f"partition {self.partition}: no source of {kind!r} records; a worker "
                f"consumes {', '.join(self._sources)}"
            ) from None

    def committed_offset(self, kind: str) -> int:
        """The next offset of ``kind`` the local state covers (0 if none)."""
        return self.db.offset(kind) or 0

    def end_offset(self, kind: str) -> int:
        """The end of the topic partition as the consumer last heard it from the broker
        (the next offset the local state covers until it has)."""
        committed = self.committed_offset(kind)
        high = self._high_watermark(kind, self.partition) if self._high_watermark else None
        return committed if high is None else max(committed, high)

    def revoke(self) -> None:
        """No commit may change anything from now on (the partition has a new owner)."""
        self._revoked = True

    async def commit(self, batch: CommitBatch) -> None:
        if not (batch.appends or batch.puts or batch.deletes or batch.offsets):
            return  # trims: Kafka keeps to the topics' own retention
        if self._revoked or self.db.closed:
            raise PartitionRevoked(f"partition {self.partition} is no longer owned here")
        records: list[OutRecord] = []
        last_history = -1
        name = self._topics.name
        for append in batch.appends:
            partition = append.partition
            if partition is None:
                partition = partition_for(append.key.decode(), self.partitions)
            if append.kind == HISTORY:
                if partition != self.partition:
                    raise ValueError(
                        f"partition {self.partition} cannot append history to partition "
                        f"{partition}: history is co-partitioned with commands"
                    )
                last_history = len(records)
            records.append(OutRecord(name(append.kind), partition, append.key, append.value))
        commands_offset = batch.offsets.get(COMMANDS)
        if last_history >= 0 and commands_offset is not None:
            tail = records[last_history]
            records[last_history] = OutRecord(
                tail.topic,
                tail.partition,
                tail.key,
                tail.value,
                [(keys.HEADER_OFFSETS, keys.encode_offsets_header(self.epoch, commands_offset))],
            )
        try:
            offsets = await self._send(records)
            if self._revoked or self.db.closed:
                # Produced, but the state is no longer ours to write; the next owner's
                # restore folds these records (or skips them, after its fence).
                raise PartitionRevoked(f"partition {self.partition} was revoked during a commit")
            await self._check_gaps(records, offsets)
            if self._revoked or self.db.closed:
                raise PartitionRevoked(f"partition {self.partition} was revoked during a commit")
            covered = dict(batch.offsets)
            tail_crc = None
            if last_history >= 0:
                covered[HISTORY] = offsets[last_history] + 1
                value = records[last_history].value
                tail_crc = zlib.crc32(value or b"")
            self.db.write(
                puts=batch.puts.items(),
                deletes=batch.deletes,
                offsets=covered,
                history_tail=tail_crc,
            )
        except (PartitionRevoked, asyncio.CancelledError):
            raise
        except Exception as exc:
            # Part of the batch may be on the topics already: this owner cannot redo it.
            self._revoked = True
            self._on_failure(exc)
            raise PartitionLost(f"partition {self.partition}: commit failed: {exc}") from exc
        for kind, offset in batch.offsets.items():
            self._consumed(kind, self.partition, offset)
        if self.snapshots is not None and not self._revoked:
            self.snapshots.maybe_take(self.db)

    async def _send(self, records: list[OutRecord]) -> list[int]:
        """Produce the batch. Dead letters first, acknowledged before the rest: the offsets
        header on the history says their commands are done, so a crash must not leave
        that header on the topic without the dead letters."""
        dead = self._topics.name(DEAD_LETTERS)
        first = [i for i, r in enumerate(records) if r.topic == dead]
        if not first or len(first) == len(records):
            return await self._producer.send(records)
        rest = [i for i, r in enumerate(records) if r.topic != dead]
        offsets = [0] * len(records)
        for group in (first, rest):
            for i, offset in zip(
                group, await self._producer.send([records[i] for i in group]), strict=True
            ):
                offsets[i] = offset
        return offsets

    async def _check_gaps(self, records: list[OutRecord], offsets: list[int]) -> None:
        """Only this owner appends to its history partition, so its records land right
        after the ones its state covers. A gap means another worker appended: a stale
        owner of a lower epoch (its records are ignored by every reader; carry on), or a
        newer owner's fence (this one was deposed: what it just produced is ignored by
        every reader, its state stays as it was, consistent with the history before the
        gap, and it stops processing the partition, which the group hands over)."""
        history = self._topics.name(HISTORY)
        expected = self.db.offset(HISTORY)
        for record, offset in zip(records, offsets, strict=True):
            if record.topic != history:
                continue
            if expected is not None and offset != expected:
                newer = 0
                if self._fences_between is not None:
                    newer = await self._fences_between(self.partition, expected, offset)
                if self._fences_between is None or newer > self.epoch:
                    self._revoked = True
                    raise PartitionFenced(
                        f"partition {self.partition}: another worker fenced {history} "
                        f"(epoch {newer or 'unknown'}, ours {self.epoch}) between offsets "
                        f"{expected} and {offset}; this worker stops processing the "
                        "partition. If no rebalance follows, two consumer groups may be "
                        "using one topic prefix"
                    )
            expected = offset + 1
