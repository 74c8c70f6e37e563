"""One partition's local state: a RocksDB per assigned partition, opened on assign and
closed on revoke (quixstreams' layout), holding the engine's state and, in the same
atomic WriteBatch, the offsets of the topics that state covers.

Kafka is the source of truth and this is a cache of it: writes are not fsynced (a kill -9
keeps them, the OS has them; a machine crash loses a suffix, which restore reads back
from the history topic). Writes are small and run on the event loop's thread.

So damaged state is never repaired: a partition directory RocksDB reports damaged (at
open, or on a read) is moved aside (``quarantine``) and rebuilt from the topics.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from stepstream.consumers import rocks as rocks_helpers
from stepstream.consumers.kafka import keys
from stepstream.consumers.rocks import (
    is_corruption,
    is_disk_full,
    is_missing_file,
    pinned_scan,
    prefix_scan,
    prefix_scans,
    reverse_scan,
)
from stepstream.consumers.rocks_memory import RocksMemory
from stepstream.engine.errors import StepstreamError

log = logging.getLogger("stepstream.kafka.db")


class StateFormatError(Exception):
    """The directory holds state this version cannot read."""


class StateCorrupted(Exception):
    """RocksDB found a partition's directory damaged. Its state is a cache of the
    topics: the directory is quarantined and the state rebuilt from them."""

    def __init__(self, path: str, partition: int, detail: str) -> None:
        super().__init__(f"partition={partition} state in {path} is damaged ({detail})")
        self.path = path
        self.partition = partition
        self.detail = detail


class StateWriteFailed(StepstreamError):
    """Writing a partition's state failed (a full or failing disk)."""


class PartitionDB:
    """Use ``PartitionDB.open(path, partition, partitions)``; not thread-safe for writes."""

    def __init__(self, path: str, partition: int, db: Any, memory: RocksMemory) -> None:
        self.path = path
        self.partition = partition
        self.memory = memory
        # Told (once) when a read finds the state damaged.
        self.on_corrupt: Callable[[StateCorrupted], None] | None = None
        self.corrupted: StateCorrupted | None = None
        self._write_options = WriteOptions()
        self._write_options.sync = False
        self._attach(db)

    def _attach(self, db: Any) -> None:
        self._db: Any = db
        self._state: Any = db.get_column_family(keys.STATE_CF)
        self._meta: Any = db.get_column_family(keys.META_CF)
        self._state_handle: Any = db.get_column_family_handle(keys.STATE_CF)
        self._meta_handle: Any = db.get_column_family_handle(keys.META_CF)

    @classmethod
    def open(
        cls, path: str, partition: int, partitions: int, memory: RocksMemory | None = None
    ) -> PartitionDB:
        """Open (creating) the state of ``partition``. State made for another partition
        count belongs to other topics: it is discarded, and restore rebuilds it. Raises
        ``StateCorrupted`` if RocksDB finds the directory damaged (``quarantine`` it).
        ``memory``: the process's RocksDB budget this database shares."""
        memory = memory or RocksMemory()
        try:
            rocks = _open_rocks(path, memory)
        except Exception as exc:
            if is_corruption(exc) or is_missing_file(exc):
                raise StateCorrupted(path, partition, _detail(exc)) from exc
            raise
        db = cls(path, partition, rocks, memory)
        try:
            db._check(partitions)
        except BaseException:
            db.close()
            raise
        return db

    def _check(self, partitions: int) -> None:
        stored_format = self._meta_u64(keys.META_FORMAT)
        if stored_format is not None and stored_format != keys.FORMAT_VERSION:
            raise StateFormatError(
                f"{self.path} holds Kafka-backend state format {stored_format}; this "
                f"stepstream reads format {keys.FORMAT_VERSION}: remove the directory (it "
                "is rebuilt from the history topic)"
            )
        stored_count = self._meta_u64(keys.META_PARTITIONS)
        if stored_count is not None and stored_count != partitions:
            log.warning(
                "state in %s was made for %d partitions, the topics have %d: discarding it "
                "and restoring from the history topic",
                self.path,
                stored_count,
                partitions,
                extra={"partition": self.partition},
            )
            self.wiped()
        if stored_count != partitions:
            batch = WriteBatch(raw_mode=True)
            batch.put(keys.META_FORMAT, keys.encode_u64(keys.FORMAT_VERSION), self._meta_handle)
            batch.put(keys.META_PARTITIONS, keys.encode_u64(partitions), self._meta_handle)
            self._db.write(batch, self._write_options)

    # ---- the engine's StateStore ------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        try:
            value: bytes | None = self._state.get(key)
        except Exception as exc:
            raise self._damaged(exc) from exc
        return value

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Keys starting with ``prefix``, from ``start`` (default: the prefix) on, in key
        order."""
        return prefix_scan(self._state, prefix, start, on_error=self._damaged)

    def scan_reverse(
        self, prefix: bytes, before: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Keys starting with ``prefix`` and below ``before`` (default: all of them),
        greatest first."""
        return reverse_scan(self._state, prefix, before, on_error=self._damaged)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys`` in their order (None where absent): one multi-get."""
        if not keys:
            return []
        try:
            values: list[bytes | None] = self._state.get(list(keys))
        except Exception as exc:
            raise self._damaged(exc) from exc
        return values

    def scan_many(self, prefixes: Sequence[bytes]) -> list[list[tuple[bytes, bytes]]]:
        """For each of ``prefixes``, its keys in key order, read in one iterator pass."""
        return prefix_scans(self._state, prefixes, on_error=self._damaged)

    def pinned_scan(self, prefix: bytes) -> Generator[tuple[bytes, bytes], None, None]:
        """Keys starting with ``prefix`` as they are now, however long the reading takes
        and whatever is written meanwhile (several made in a row, with no write between
        them, are one consistent view). Close or exhaust it: it keeps RocksDB open."""
        return pinned_scan(self._state, prefix, on_error=self._damaged)

    @property
    def empty(self) -> bool:
        return next(prefix_scan(self._state, b"", on_error=self._damaged), None) is None

    # ---- what the state covers ---------------------------------------------------------

    def offset(self, kind: str) -> int | None:
        """The next offset of ``kind`` this state has consumed, or None if never."""
        return self._meta_u64(keys.offset_key(kind))

    @property
    def epoch(self) -> int:
        """The highest fencing epoch folded into this state (0 if none)."""
        return self._meta_u64(keys.META_EPOCH) or 0

    @property
    def history_tail(self) -> int | None:
        """CRC-32 of the last history record this state covers."""
        return self._meta_u64(keys.META_HISTORY_TAIL)

    def offset_meta(self, key: bytes) -> int | None:
        """Another unsigned number kept in ``meta`` (``keys.META_*``)."""
        return self._meta_u64(key)

    def write(
        self,
        *,
        puts: Iterable[tuple[bytes, bytes]] = (),
        deletes: Iterable[bytes] = (),
        offsets: Mapping[str, int] | None = None,
        epoch: int | None = None,
        history_tail: int | None = None,
        meta: Mapping[bytes, int] | None = None,
    ) -> None:
        """One atomic write: state changes (deletes first) and the offsets they cover."""
        batch = WriteBatch(raw_mode=True)
        state = self._state_handle
        for key in deletes:
            batch.delete(key, state)
        for key, value in puts:
            batch.put(key, value, state)
        meta_cf = self._meta_handle
        for kind, offset in (offsets or {}).items():
            batch.put(keys.offset_key(kind), keys.encode_u64(offset), meta_cf)
        if epoch is not None:
            batch.put(keys.META_EPOCH, keys.encode_u64(epoch), meta_cf)
        if history_tail is not None:
            batch.put(keys.META_HISTORY_TAIL, keys.encode_u64(history_tail), meta_cf)
        for key, number in (meta or {}).items():
            batch.put(key, keys.encode_u64(number), meta_cf)
        try:
            self._db.write(batch, self._write_options)
        except Exception as exc:
            if is_disk_full(exc):
                raise StateWriteFailed(
                    f"partition={self.partition}: the disk holding {self.path} is full "
                    f"({_detail(exc)}); free space on it (the partitions are restored "
                    "from the topics meanwhile by whichever worker takes them)"
                ) from exc
            if is_corruption(exc):
                raise self._damaged(exc) from exc
            raise StateWriteFailed(
                f"partition={self.partition}: writing its state to {self.path} failed "
                f"({_detail(exc)}); check the disk"
            ) from exc

    def wiped(self) -> PartitionDB:
        """Close, delete everything, and reopen empty (the same partition, and the same
        object, so every holder sees the new state)."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)
        self._attach(_open_rocks(self.path, self.memory))
        self.corrupted = None
        return self

    def close(self) -> None:
        if self._db is None:
            return
        self._state_handle = self._meta_handle = None
        self._state.close()
        self._meta.close()
        self._db.close()
        self._db = None

    @property
    def closed(self) -> bool:
        return self._db is None

    def _meta_u64(self, key: bytes) -> int | None:
        try:
            raw: bytes | None = self._meta.get(key)
        except Exception as exc:
            raise self._damaged(exc) from exc
        return None if raw is None else keys.decode_u64(raw)

    def _damaged(self, exc: Exception) -> Exception:
        """The error to raise for one RocksDB raised on a read: ``StateCorrupted`` (and
        ``on_corrupt`` told, once) when it found damage."""
        if not is_corruption(exc):
            return exc
        if self.corrupted is None:
            self.corrupted = StateCorrupted(self.path, self.partition, _detail(exc))
            if self.on_corrupt is not None:
                self.on_corrupt(self.corrupted)
        return StateCorrupted(self.path, self.partition, self.corrupted.detail)


def quarantine(path: str, reason: str, partition: int | None = None) -> str | None:
    """Move a damaged partition directory aside (``<path>.corrupt-<UTC time>``), kept for
    a post-mortem; returns where it went (None if there was nothing). A marker left by
    ``mark_damaged`` goes with it. ``partition`` goes into the warning's fields."""
    marker = Path(_marker(path))
    if not os.path.exists(path):
        marker.unlink(missing_ok=True)
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = f"{path}.corrupt-{stamp}"
    n = 1
    while os.path.exists(target):
        n += 1
        target = f"{path}.corrupt-{stamp}-{n}"
    os.rename(path, target)
    if marker.exists():
        os.rename(marker, os.path.join(target, "DAMAGED"))
    log.warning(
        "%s: moved it to %s and rebuilding the state from the topics; delete %s once no "
        "post-mortem needs it",
        reason,
        target,
        target,
        extra={"partition": partition},
    )
    return target


def mark_damaged(path: str, reason: str) -> None:
    """Note, next to a partition directory that cannot be moved now (it is open), that
    it is damaged: the next ``needs_quarantine`` says so, even if RocksDB opens it."""
    with open(_marker(path), "w") as f:
        f.write(reason + "\n")


def needs_quarantine(path: str) -> str | None:
    """Why ``mark_damaged`` marked this directory, or None."""
    try:
        with open(_marker(path)) as f:
            return f.read().strip() or "marked damaged"
    except FileNotFoundError:
        return None


def _marker(path: str) -> str:
    return path.rstrip("/") + ".damaged"


def _detail(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _open_rocks(path: str, memory: RocksMemory) -> Any:
    os.makedirs(path, exist_ok=True)
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.create_missing_column_families(True)
    options.set_keep_log_file_num(2)
    options.set_max_total_wal_size(rocks_helpers.MAX_TOTAL_WAL_BYTES)
    families = {name: Options(raw_mode=True) for name in keys.COLUMN_FAMILIES}
    memory.apply(options, families)
    return Rdict(path, options, column_families=families)
