"""One partition's local state: a RocksDB per assigned partition, opened on assign and
closed on revoke (quixstreams' layout), holding the engine's state and, in the same
atomic WriteBatch, the offsets of the topics that state covers.

Kafka is the source of truth and this is a cache of it: writes are not fsynced (a kill -9
keeps them, the OS has them; a machine crash loses a suffix, which restore reads back
from the history topic). Writes are small and run on the event loop's thread.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from consumers.kafka import keys
from consumers.rocks import prefix_scan

log = logging.getLogger("stepstream.kafka.db")


class StateFormatError(Exception):
    """The directory holds state this version cannot read."""


class PartitionDB:
    """Use ``PartitionDB.open(path, partition, partitions)``; not thread-safe for writes."""

    def __init__(self, path: str, partition: int, db: Any) -> None:
        self.path = path
        self.partition = partition
        self._db: Any = db
        self._state: Any = db.get_column_family(keys.STATE_CF)
        self._meta: Any = db.get_column_family(keys.META_CF)
        self._state_handle: Any = db.get_column_family_handle(keys.STATE_CF)
        self._meta_handle: Any = db.get_column_family_handle(keys.META_CF)
        self._write_options = WriteOptions()
        self._write_options.sync = False

    @classmethod
    def open(cls, path: str, partition: int, partitions: int) -> PartitionDB:
        """Open (creating) the state of ``partition``. State made for another partition
        count belongs to other topics: it is discarded, and restore rebuilds it."""
        db = cls(path, partition, _open_rocks(path))
        stored_format = db._meta_u64(keys.META_FORMAT)
        if stored_format is not None and stored_format != keys.FORMAT_VERSION:
            db.close()
            raise StateFormatError(
                f"{path} holds Kafka-backend state format {stored_format}; this stepstream "
                f"reads format {keys.FORMAT_VERSION}: remove the directory (it is rebuilt "
                "from the history topic)"
            )
        stored_count = db._meta_u64(keys.META_PARTITIONS)
        if stored_count is not None and stored_count != partitions:
            log.warning(
                "partition=%d state in %s was made for %d partitions, the topics have %d: "
                "discarding it and restoring from the history topic",
                partition,
                path,
                stored_count,
                partitions,
            )
            db = db.wiped()
        if stored_count != partitions:
            batch = WriteBatch(raw_mode=True)
            batch.put(keys.META_FORMAT, keys.encode_u64(keys.FORMAT_VERSION), db._meta_handle)
            batch.put(keys.META_PARTITIONS, keys.encode_u64(partitions), db._meta_handle)
            db._db.write(batch, db._write_options)
        return db

    # ---- the engine's StateStore ------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        value: bytes | None = self._state.get(key)
        return value

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Keys starting with ``prefix``, in key order."""
        return prefix_scan(self._state, prefix)

    @property
    def empty(self) -> bool:
        it = self._state.iter()
        it.seek_to_first()
        return not it.valid()

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
        self._db.write(batch, self._write_options)

    def wiped(self) -> PartitionDB:
        """Close, delete everything, and reopen empty (the same partition)."""
        path, partition = self.path, self.partition
        self.close()
        shutil.rmtree(path, ignore_errors=True)
        return PartitionDB(path, partition, _open_rocks(path))

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
        raw: bytes | None = self._meta.get(key)
        return None if raw is None else keys.decode_u64(raw)


def _open_rocks(path: str) -> Any:
    os.makedirs(path, exist_ok=True)
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.create_missing_column_families(True)
    options.set_keep_log_file_num(2)
    families = {name: Options(raw_mode=True) for name in keys.COLUMN_FAMILIES}
    return Rdict(path, options, column_families=families)
