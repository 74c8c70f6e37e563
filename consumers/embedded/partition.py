"""One partition of the embedded backend, as the engine's ``PartitionBackend`` seam.

Its state is the slice of the ``state`` column family under the partition's prefix, its
sources read the embedded log from the offsets committed with that state, and a commit
is one atomic, durable write of appends, state changes and offsets together.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from stepstream.consumers.embedded import keys
from stepstream.consumers.embedded.db import EmbeddedDB
from stepstream.consumers.embedded.log import EmbeddedLog
from stepstream.engine.seams import CommitBatch, LogEntry


class EmbeddedStore:
    """The committed state of one partition; keys are local to it."""

    def __init__(self, db: EmbeddedDB, partition: int) -> None:
        self._db = db
        self._prefix = keys.state_user_prefix(partition)

    def get(self, key: bytes) -> bytes | None:
        return self._db.get(keys.STATE_CF, self._prefix + key)

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Keys starting with ``prefix``, from ``start`` (default: the prefix) on, in key
        order."""
        cut = len(self._prefix)
        begin = None if start is None else self._prefix + start
        for key, value in self._db.scan(keys.STATE_CF, self._prefix + prefix, begin):
            yield key[cut:], value

    def scan_reverse(
        self, prefix: bytes, before: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Keys starting with ``prefix`` and below ``before`` (default: all of them),
        greatest first."""
        cut, own = len(self._prefix), self._prefix
        end = None if before is None else own + before
        for key, value in self._db.scan_reverse(keys.STATE_CF, own + prefix, end):
            yield key[cut:], value

    def get_many(self, keys_: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys_`` in their order (None where absent): one multi-get."""
        own = self._prefix
        return self._db.get_many(keys.STATE_CF, [own + key for key in keys_])

    def scan_many(self, prefixes: Sequence[bytes]) -> list[list[tuple[bytes, bytes]]]:
        """For each of ``prefixes``, its keys in key order, read in one iterator pass."""
        own, cut = self._prefix, len(self._prefix)
        found = self._db.scan_many(keys.STATE_CF, [own + prefix for prefix in prefixes])
        return [[(key[cut:], value) for key, value in each] for each in found]


class EmbeddedSource:
    """One topic partition of the embedded log, read from ``position`` on."""

    def __init__(self, log: EmbeddedLog, kind: str, partition: int, position: int) -> None:
        self.kind = kind
        self.partition = partition
        self.position = position
        self._log = log

    async def fetch(self, max_records: int, timeout: float) -> list[LogEntry]:
        """The next records (at most ``max_records``), waiting up to ``timeout`` seconds
        for the first one; an empty list when none came."""
        entries = self._log.read(self.kind, self.partition, self.position, max_records)
        if not entries and max_records > 0:
            if await self._log.wait(self.kind, self.partition, self.position, timeout):
                entries = self._log.read(self.kind, self.partition, self.position, max_records)
        if entries:
            self.position = entries[-1].offset + 1
        return entries

    def rewind(self, offset: int) -> None:
        self.position = offset

    def end_heard(self) -> int | None:
        return self._log.end_offset(self.kind, self.partition)  # the log is local: exact


class EmbeddedPartition:
    """Partition ``partition`` of an open ``EmbeddedDB``. Fenced by the directory lock:
    only one process can hold these, so ``epoch`` is the directory's open count."""

    def __init__(self, db: EmbeddedDB, partition: int) -> None:
        if not 0 <= partition < db.partitions:
            raise ValueError(
                f"partition {partition} is out of range: {db.path} has {db.partitions} partitions"
            )
        self.partition = partition
        self.partitions = db.partitions
        self.epoch = db.epoch
        self.previous_epoch = db.epoch - 1  # each open of the directory counts one up
        self._db = db
        self._store = EmbeddedStore(db, partition)
        self._user_prefix = keys.state_user_prefix(partition)

    @property
    def store(self) -> EmbeddedStore:
        return self._store

    def source(self, kind: str) -> EmbeddedSource:
        """A source of ``kind`` records of this partition, from the committed offset on."""
        return EmbeddedSource(self._db.log, kind, self.partition, self.committed_offset(kind))

    def committed_offset(self, kind: str) -> int:
        """The next offset of ``kind`` to consume, as last committed (0 if never)."""
        stored = self._db.get(keys.STATE_CF, keys.state_offset_key(self.partition, kind))
        return 0 if stored is None else keys.decode_u64(stored)

    def end_offset(self, kind: str) -> int:
        return self._db.log.end_offset(kind, self.partition)

    async def commit(self, batch: CommitBatch) -> None:
        """Make ``batch`` durable as one atomic write: its appends (at offsets the writer
        assigns), its state changes and its consumed offsets, or none of them."""
        if not batch:
            return
        resolve = self._db.log.resolve
        # Most appends name their partition; the write checks those (``_check_write``).
        appends = [a if a.partition is not None else resolve(a) for a in batch.appends]
        puts = [(self._user_prefix + key, value) for key, value in batch.puts.items()]
        for kind, offset in batch.offsets.items():
            end = self._db.log.end_offset(kind, self.partition)
            if not 0 <= offset <= end:
                raise ValueError(
                    f"partition {self.partition}: cannot commit {kind} offset {offset}, "
                    f"the log ends at {end}"
                )
            puts.append((keys.state_offset_key(self.partition, kind), keys.encode_u64(offset)))
        deletes = [self._user_prefix + key for key in batch.deletes]
        trims = [
            (keys.log_key(kind, self.partition, 0), keys.log_key(kind, self.partition, offset))
            for kind, offset in batch.trims.items()
        ]
        await self._db.write(appends=appends, puts=puts, deletes=deletes, trims=trims)
