"""The embedded backend's one RocksDB: who owns the data directory, and durable writes.

One process owns a data directory (an ``flock`` on ``stepstream.lock``); every open bumps
a durable fencing epoch. The log and every partition's state live in one RocksDB, so a
commit (appended records + state changes + consumed offsets) is one atomic WriteBatch.

Writes are group-committed: callers queue a write and await it; one writer coroutine
takes everything queued while the previous batch was being made durable, merges it into
one WriteBatch, and hands that to one dedicated thread that writes and fsyncs it. Log
offsets are assigned by the writer, so records appended by different callers to the same
topic partition never collide, and readers see a record only once it is durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from rocksdict import WriteBatch, WriteOptions

from stepstream.consumers.embedded import keys
from stepstream.consumers.embedded.datadir import (
    Durability,
    Handles,
    corrupted,
    detail,
    open_data_dir,
    release,
    write_failure,
)
from stepstream.consumers.embedded.errors import (
    StorageFailed,
)
from stepstream.consumers.embedded.log import EmbeddedLog
from stepstream.consumers.embedded.wal import WalSync
from stepstream.consumers.rocks import (
    check_status,
    is_corruption,
    prefix_scan,
    prefix_scans,
    reverse_scan,
)
from stepstream.consumers.rocks_memory import RocksMemory
from stepstream.engine.seams import Append

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Write:
    """One caller's share of a group commit."""

    appends: Sequence[Append]
    puts: Sequence[tuple[bytes, bytes]]
    deletes: Sequence[bytes]
    trims: Sequence[tuple[bytes, bytes]] = ()  # [begin, end) key ranges of the log


@dataclass(slots=True)
class _Queued:
    write: _Write
    done: asyncio.Future[list[tuple[int, int]]]


class EmbeddedDB:
    """Open with ``await EmbeddedDB.open(path)``; close with ``await db.close()`` (or use
    ``async with``). Not thread-safe: use it from the event loop that opened it."""

    def __init__(
        self,
        *,
        path: str,
        partitions: int,
        epoch: int,
        durability: Durability,
        rocks: Handles,
        lock_fd: int,
        wal: WalSync | None,
    ) -> None:
        self.path = path
        self.partitions = partitions
        self.epoch = epoch
        self.durability = durability
        # Counters: batches written is the number of fsyncs made for callers' writes.
        self.batches_written = 0
        self.writes_committed = 0
        self._rocks: Handles | None = rocks
        self._lock_fd = lock_fd
        self._wal = wal
        self._write_options = WriteOptions()
        self._write_options.sync = durability is Durability.ROCKSDB_SYNC
        self._queue: list[_Queued] = []
        self._wakeup = asyncio.Event()
        self._failure: StorageFailed | None = None
        self._failed = asyncio.Event()
        self._closing = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="stepstream-embedded-writer")
        self.log = EmbeddedLog(self)
        self._writer = asyncio.get_running_loop().create_task(
            self._run_writer(), name=f"stepstream-embedded-writer:{path}"
        )

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        partitions: int | None = None,
        *,
        durability: Durability = Durability.FSYNC_WAL,
        memory: RocksMemory | None = None,
    ) -> EmbeddedDB:
        """Open (creating if needed) the data directory ``path``. ``partitions`` defaults
        to the directory's own count, or ``DEFAULT_PARTITIONS`` for a new one. ``memory``:
        the process's RocksDB budget (the default one if not given)."""
        if partitions is not None and partitions < 1:
            raise ValueError(f"partitions must be at least 1, got {partitions}")
        data_dir = os.fspath(path)
        opened = await asyncio.to_thread(
            open_data_dir, data_dir, partitions, durability, memory or RocksMemory()
        )
        rocks, lock_fd, count, epoch, wal = opened
        try:
            db = cls(
                path=data_dir,
                partitions=count,
                epoch=epoch,
                durability=durability,
                rocks=rocks,
                lock_fd=lock_fd,
                wal=wal,
            )
        except BaseException:
            # The log reads every partition's end: a damaged file may show up there.
            await asyncio.to_thread(release, rocks, wal, lock_fd)
            raise
        log.info(
            "embedded data directory opened",
            extra={
                "path": data_dir,
                "partitions": count,
                "epoch": epoch,
                "durability": durability.value,
                "direct_io": (
                    "yes" if rocks.direct_io else "no (O_DIRECT is refused here or not available)"
                ),
            },
        )
        return db

    async def __aenter__(self) -> EmbeddedDB:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._rocks is None

    @property
    def failure(self) -> StorageFailed | None:
        """Why this directory takes no more writes, or None."""
        return self._failure

    async def failed(self) -> StorageFailed:
        """Wait until a write or read fails for good (the disk is full or damaged) and
        return why; whoever runs the engine stops it then, with that message."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    async def write(
        self,
        *,
        appends: Sequence[Append] = (),
        puts: Sequence[tuple[bytes, bytes]] = (),
        deletes: Sequence[bytes] = (),
        trims: Sequence[tuple[bytes, bytes]] = (),
    ) -> list[tuple[int, int]]:
        """Make one atomic write durable; return the (partition, offset) of each append.

        ``appends`` must have their partition resolved (``EmbeddedLog.resolve``); ``puts``
        and ``deletes`` are full keys of the state column family (deletes apply first).
        If the awaiting task is cancelled before the writer takes the write, it is not
        written; once taken, it is written whether or not anyone still waits."""
        self._check_writable()
        _check_write(appends, puts, deletes, self.partitions)
        done: asyncio.Future[list[tuple[int, int]]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Queued(_Write(appends, puts, deletes, trims), done))
        self._wakeup.set()
        return await done

    def get(self, cf: str, key: bytes) -> bytes | None:
        column = self._cf(cf)
        try:
            value: bytes | None = column.get(key)
        except Exception as exc:
            raise self._read_failed(exc) from exc
        return value

    def scan(
        self, cf: str, prefix: bytes, start: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Keys of ``cf`` that start with ``prefix``, from ``start`` (default: the prefix)
        on, in key order. Exhaust or drop the iterator: a live one keeps RocksDB open."""
        return prefix_scan(self._cf(cf), prefix, start, on_error=self._read_failed)

    def scan_reverse(
        self, cf: str, prefix: bytes, before: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        """Keys of ``cf`` that start with ``prefix`` and are below ``before`` (default:
        all of them), greatest first. Exhaust or drop the iterator."""
        return reverse_scan(self._cf(cf), prefix, before, on_error=self._read_failed)

    def get_many(self, cf: str, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys`` of ``cf`` in their order (None where absent): one
        multi-get."""
        if not keys:
            return []
        try:
            values: list[bytes | None] = self._cf(cf).get(list(keys))
        except Exception as exc:
            raise self._read_failed(exc) from exc
        return values

    def scan_many(self, cf: str, prefixes: Sequence[bytes]) -> list[list[tuple[bytes, bytes]]]:
        """For each of ``prefixes``, the keys of ``cf`` under it in key order, read in one
        iterator pass (``consumers.rocks.prefix_scans``)."""
        return prefix_scans(self._cf(cf), prefixes, on_error=self._read_failed)

    def last(self, cf: str, prefix: bytes) -> tuple[bytes, bytes] | None:
        """The greatest key of ``cf`` that starts with ``prefix``, and its value."""
        it = self._cf(cf).iter()
        successor = _successor(prefix)
        if successor is None:
            it.seek_to_last()
        else:
            it.seek(successor)
            if it.valid():
                it.prev()
            else:
                it.seek_to_last()
        if not it.valid():
            check_status(it, self._read_failed)
            return None
        key: bytes = it.key()
        if not key.startswith(prefix):
            return None
        value: bytes = it.value()
        return key, value

    async def close(self) -> None:
        """Finish queued writes, then release RocksDB and the directory lock."""
        if self._rocks is None:
            return
        self._closing = True
        self._wakeup.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._writer
        self.log.close()
        rocks, self._rocks = self._rocks, None
        # Closing flushes memtables, which can take a while: off the event loop.
        await asyncio.to_thread(release, rocks, self._wal, self._lock_fd)
        self._executor.shutdown(wait=True)
        log.info("embedded data directory closed", extra={"path": self.path})

    def _cf(self, name: str) -> Any:
        if self._rocks is None:
            raise RuntimeError(f"embedded data directory {self.path} is closed")
        return self._rocks.cfs[name]

    def _check_writable(self) -> None:
        if self._failure is not None:
            # A new exception each time: one raised again and again grows its traceback.
            raise type(self._failure)(str(self._failure))
        if self._closing or self._rocks is None:
            raise RuntimeError(f"embedded data directory {self.path} is closed")

    async def _run_writer(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            taken = [queued for queued in self._queue if not queued.done.cancelled()]
            self._queue = []
            if not taken:
                continue
            staged: dict[tuple[str, int], int] = {}
            try:
                batch, positions = self._stage(taken, staged)
                if len(taken) == 1:
                    # A lone writer: nothing to overlap with the fsync, and the two
                    # thread handoffs would cost as much as the fsync itself.
                    self._write_durably(batch)
                else:
                    await loop.run_in_executor(self._executor, self._write_durably, batch)
            except Exception as exc:
                self._fail(exc, taken)
                continue
            self.batches_written += 1
            self.writes_committed += len(taken)
            self.log.publish(staged)
            for queued, written in zip(taken, positions, strict=True):
                if not queued.done.done():
                    queued.done.set_result(written)

    def _stage(
        self, taken: list[_Queued], staged: dict[tuple[str, int], int]
    ) -> tuple[Any, list[list[tuple[int, int]]]]:
        """Merge the taken writes, in queue order, into one WriteBatch."""
        assert self._rocks is not None
        batch = WriteBatch(raw_mode=True)
        log_cf = self._rocks.handles[keys.LOG_CF]
        state_cf = self._rocks.handles[keys.STATE_CF]
        positions = []
        for queued in taken:
            write = queued.write
            positions.append(self.log.stage(batch, log_cf, write.appends, staged))
            for begin, end in write.trims:
                batch.delete_range(begin, end, log_cf)
            for key in write.deletes:
                batch.delete(key, state_cf)
            for key, value in write.puts:
                batch.put(key, value, state_cf)
        return batch, positions

    def _write_durably(self, batch: Any) -> None:
        """Runs on the writer thread."""
        assert self._rocks is not None
        self._rocks.db.write(batch, self._write_options)
        if self._wal is not None:
            self._wal.sync()

    def _fail(self, exc: Exception, taken: list[_Queued]) -> None:
        """A write failed: nothing more is accepted. RocksDB refuses writes after a
        failed one until it is reopened, and after a failed fsync the OS may have dropped
        the pages it could not write, so only a restart (which reads back what is
        durable) can go on safely."""
        failure = self._note_failure(write_failure(self.path, exc))
        for queued in [*taken, *self._queue]:
            if not queued.done.done():
                queued.done.set_exception(type(failure)(str(failure)))
        self._queue = []

    def _read_failed(self, exc: Exception) -> StorageFailed:
        """A read failed (a damaged block): nothing read from here can be trusted."""
        if is_corruption(exc):
            failure: StorageFailed = corrupted(self.path, exc)
        else:
            failure = StorageFailed(
                f"reading the embedded data directory {self.path} failed ({detail(exc)}); "
                "stepstream stops: fix the disk, then start it again"
            )
        self._note_failure(failure)
        return type(failure)(str(failure))

    def _note_failure(self, failure: StorageFailed) -> StorageFailed:
        if self._failure is None:
            self._failure = failure
            log.error("%s", failure)
            self._failed.set()
        return self._failure


def _check_write(
    appends: Sequence[Append],
    puts: Sequence[tuple[bytes, bytes]],
    deletes: Sequence[bytes],
    partitions: int,
) -> None:
    """Reject a malformed write in its caller, before it can share a batch with others.
    Every transition passes here: one test per item, the message only for a bad one."""
    codes = keys.KIND_CODES
    for append in appends:
        partition = append.partition
        if (
            append.kind not in codes
            or partition is None
            or not 0 <= partition < partitions
            or type(append.key) is not bytes
            or type(append.value) is not bytes
        ):
            _reject_append(append, partitions)
    for key, value in puts:
        if type(key) is not bytes or type(value) is not bytes:
            raise TypeError(f"state key and value must be bytes: {key!r}={value!r}")
    for key in deletes:
        if type(key) is not bytes:
            raise TypeError(f"state key must be bytes: {key!r}")


def _reject_append(append: Append, partitions: int) -> None:
    keys.kind_code(append.kind)  # raises for an unknown kind
    if append.partition is None or not 0 <= append.partition < partitions:
        raise ValueError(
            f"append to partition {append.partition} of {partitions}: resolve appends "
            "with EmbeddedLog.resolve first"
        )
    raise TypeError(f"record key and value must be bytes: {append!r}")


def _successor(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key that starts with ``prefix``."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return None
    return trimmed[:-1] + bytes((trimmed[-1] + 1,))
