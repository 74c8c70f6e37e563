"""The seams between the engine and a backend: clock, log source, state store, commit.

The engine never imports Kafka or RocksDB. A backend (embedded, Kafka) provides, per
owned partition, a ``Source`` of records to consume, a ``StateStore`` to read state, and a
``commit`` that makes a ``CommitBatch`` durable: appended records first, then state
changes together with the source offsets they cover, in one atomic write.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from stepstream.engine.wire.values import value


class Clock(Protocol):
    def now_ms(self) -> int: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@value
class LogEntry:
    """One record as a log holds it: where it is, and its raw key and value.

    ``accepted_ms``: when the log took the record, as a clock the engine trusts tells it
    (a Kafka broker's append time, or when this worker's consumer received the record);
    0 when the log does not say, as the embedded engine's log, whose records the engine
    stamps itself (a command's ``time_ms``). Not part of the record's identity."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    accepted_ms: int = field(default=0, compare=False)


@value
class Append:
    """A record to append: ``kind`` is a topic kind from ``engine.wire.topics``; the partition
    is the instance's partition unless given (fence records, dead letters)."""

    kind: str
    key: bytes
    value: bytes
    partition: int | None = None


class Source(Protocol):
    """Records of one topic partition, in offset order, from where this owner resumes."""

    async def fetch(self, max_records: int, timeout: float) -> list[LogEntry]: ...

    def rewind(self, offset: int) -> None:
        """Deliver again from ``offset`` (after a failed commit)."""
        ...

    def end_heard(self) -> int | None:
        """The end of the topic partition (the offset its next record gets) as the log
        last told this reader, once every record before it was delivered here; None when
        not known (nothing heard since reading began, or records delivered past it). A
        record acknowledged to its producer before the end was heard is below it."""
        ...


class StateStore(Protocol):
    """Committed state of one partition (keys are local to the partition)."""

    def get(self, key: bytes) -> bytes | None: ...

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Keys starting with ``prefix``, from ``start`` (default: the prefix) on, in key
        order."""
        ...

    def scan_reverse(
        self, prefix: bytes, before: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Keys starting with ``prefix`` and below ``before`` (default: all of them),
        greatest first."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys``, in their order (None where absent), read at once."""
        ...

    def scan_many(self, prefixes: Sequence[bytes]) -> list[list[tuple[bytes, bytes]]]:
        """For each of ``prefixes`` (none the start of another), its keys and values in
        key order, as ``scan`` gives them, read in one ordered pass."""
        ...


@dataclass(slots=True)
class CommitBatch:
    appends: list[Append] = field(default_factory=list)
    puts: dict[bytes, bytes] = field(default_factory=dict)
    deletes: set[bytes] = field(default_factory=set)
    # topic kind -> next offset to consume from it, applied with the state changes
    offsets: dict[str, int] = field(default_factory=dict)
    # Topic kind -> offset of this partition below which its log records are no longer
    # needed. A backend with a local log drops them; Kafka leaves it to topic retention.
    trims: dict[str, int] = field(default_factory=dict)

    def put(self, key: bytes, value: bytes) -> None:
        self.deletes.discard(key)
        self.puts[key] = value

    def delete(self, key: bytes) -> None:
        self.puts.pop(key, None)
        self.deletes.add(key)

    def __bool__(self) -> bool:
        return bool(self.appends or self.puts or self.deletes or self.offsets or self.trims)


class PartitionLost(Exception):
    """Raised by ``commit`` when the backend gave the partition up (revoked, or a failure
    it cannot undo): the processor stops, and the next owner restores from the log. Any
    other exception from ``commit`` means nothing was made durable, or all of it was."""


class PartitionBackend(Protocol):
    """What one partition's processor (or timer service) needs from a backend."""

    partition: int
    partitions: int
    epoch: int
    # The epoch of the owner that last wrote this partition's state where this one reads
    # it (0 if none): a mark an owner left there is this owner's to trust only if it was
    # left by that owner or this one, with nobody (an older version) writing in between.
    previous_epoch: int

    @property
    def store(self) -> StateStore: ...

    def source(self, kind: str) -> Source: ...

    def committed_offset(self, kind: str) -> int: ...

    def end_offset(self, kind: str) -> int:
        """The next offset of this partition's ``kind`` records, as far as it knows."""
        ...

    async def commit(self, batch: CommitBatch) -> None: ...
