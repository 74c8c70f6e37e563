"""The embedded durable log: topic kinds x partitions of dense offsets, starting at 0.

Records live in the ``log`` column family of the data directory's RocksDB. End offsets
are recovered at open by seeking each partition's last key, and advance only after the
writer has made a batch durable, so a reader never sees a record that could be lost.
Readers waiting for a partition to grow are woken by the writer (one ``asyncio.Event``
per topic partition), never by polling.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from stepstream.consumers.embedded import keys
from stepstream.engine.seams import Append, LogEntry
from stepstream.engine.wire.topics import murmur2

if TYPE_CHECKING:
    from stepstream.consumers.embedded.db import EmbeddedDB

_TopicPartition = tuple[str, int]


class EmbeddedLog:
    """Built by ``EmbeddedDB.open`` as ``db.log``."""

    def __init__(self, db: EmbeddedDB) -> None:
        self._db = db
        self.partitions = db.partitions
        self._ends: dict[_TopicPartition, int] = {}
        self._grown: dict[_TopicPartition, asyncio.Event] = {}
        self._closed = False
        for kind in keys.KIND_CODES:
            for partition in range(self.partitions):
                last = db.last(keys.LOG_CF, keys.log_partition_prefix(kind, partition))
                if last is not None:
                    self._ends[(kind, partition)] = keys.log_offset(last[0]) + 1

    def resolve(self, append: Append) -> Append:
        """``append`` with its partition set: the key's (Kafka's murmur2 partitioner, as
        ``engine.wire.topics.partition_for``) unless given. Rejects unknown kinds and partitions."""
        keys.kind_code(append.kind)
        if append.partition is None:
            partition = (murmur2(append.key) & 0x7FFFFFFF) % self.partitions
            return dataclasses.replace(append, partition=partition)
        self._check_partition(append.partition)
        return append

    async def append(self, appends: Sequence[Append]) -> list[tuple[int, int]]:
        """Append durably; return the (partition, offset) of each record, in order."""
        resolved = [self.resolve(append) for append in appends]
        if not resolved:
            return []
        return await self._db.write(appends=resolved)

    def end_offset(self, kind: str, partition: int) -> int:
        """The offset the next record of this topic partition will get."""
        return self._ends.get(self._topic_partition(kind, partition), 0)

    def read(self, kind: str, partition: int, offset: int, max_records: int) -> list[LogEntry]:
        """Up to ``max_records`` durable records from ``offset`` on; never waits."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        end = min(self.end_offset(kind, partition), offset + max(max_records, 0))
        if end <= offset:
            return []
        prefix = keys.log_partition_prefix(kind, partition)
        start = keys.log_key(kind, partition, offset)
        entries = []
        for key, data in self._db.scan(keys.LOG_CF, prefix, start):
            record_offset = keys.log_offset(key)
            if record_offset >= end:
                break
            record_key, value = keys.decode_record(data)
            entries.append(LogEntry(kind, partition, record_offset, record_key, value))
        return entries

    async def wait(self, kind: str, partition: int, offset: int, timeout: float) -> bool:
        """Return True once the partition holds a record at ``offset`` (end > offset), or
        False after ``timeout`` seconds."""
        topic_partition = self._topic_partition(kind, partition)
        if self._ends.get(topic_partition, 0) > offset:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._ends.get(topic_partition, 0) <= offset:
            if self._closed:
                return False
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            grown = self._grown.get(topic_partition)
            if grown is None:
                grown = self._grown[topic_partition] = asyncio.Event()
            try:
                async with asyncio.timeout(remaining):
                    await grown.wait()
            except TimeoutError:
                return self._ends.get(topic_partition, 0) > offset
        return True

    def stage(
        self,
        batch: Any,
        log_cf: Any,
        appends: Sequence[Append],
        staged: dict[_TopicPartition, int],
    ) -> list[tuple[int, int]]:
        """Writer side: put ``appends`` into ``batch`` at the next free offsets, counting
        from ``staged`` (ends already taken by this batch) or the durable ends."""
        positions = []
        for append in appends:
            partition = append.partition
            assert partition is not None, "appends must be resolved"
            topic_partition = (append.kind, partition)
            offset = staged.get(topic_partition)
            if offset is None:
                offset = self._ends.get(topic_partition, 0)
            batch.put(
                keys.log_key(append.kind, partition, offset),
                keys.encode_record(append.key, append.value),
                log_cf,
            )
            staged[topic_partition] = offset + 1
            positions.append((partition, offset))
        return positions

    def publish(self, staged: dict[_TopicPartition, int]) -> None:
        """Writer side: the batch holding ``staged`` is durable; wake its readers."""
        for topic_partition, end in staged.items():
            self._ends[topic_partition] = end
            grown = self._grown.pop(topic_partition, None)
            if grown is not None:
                grown.set()

    def close(self) -> None:
        """Wake every waiting reader (they return False: nothing more will arrive)."""
        self._closed = True
        for grown in self._grown.values():
            grown.set()
        self._grown.clear()

    def _topic_partition(self, kind: str, partition: int) -> _TopicPartition:
        keys.kind_code(kind)
        self._check_partition(partition)
        return (kind, partition)

    def _check_partition(self, partition: int) -> None:
        if not 0 <= partition < self.partitions:
            raise ValueError(
                f"partition {partition} is out of range: {self._db.path} has "
                f"{self.partitions} partitions"
            )
