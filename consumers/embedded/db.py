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
import enum
import fcntl
import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from rocksdict import DBRecoveryMode, Options, Rdict, WriteBatch, WriteOptions

from stepstream.consumers import rocks as rocks_helpers
from stepstream.consumers.embedded import keys
from stepstream.consumers.embedded.errors import (
    DataDirCorrupted,
    DataDirInUse,
    DiskFull,
    PartitionCountMismatch,
    StorageFailed,
)
from stepstream.consumers.embedded.log import EmbeddedLog
from stepstream.consumers.embedded.wal import WalSync
from stepstream.consumers.rocks import (
    check_status,
    is_corruption,
    is_disk_full,
    is_missing_file,
    prefix_scan,
)
from stepstream.engine.errors import StepstreamError
from stepstream.engine.seams import Append

log = logging.getLogger(__name__)

DEFAULT_PARTITIONS = 4
LOCK_FILE = "stepstream.lock"
# The epoch of the last open, outside RocksDB: RocksDB files that went back to an earlier
# state (a truncated MANIFEST is read as a torn one and silently recovered from) are
# found out by an epoch below it.
EPOCH_FILE = "stepstream.epoch"
ROCKSDB_DIR = "rocksdb"


class Durability(enum.Enum):
    """How a group commit is made durable before its callers are answered."""

    # RocksDB writes the WAL without syncing; the writer thread then fsyncs the WAL files
    # itself, with the GIL released, so the event loop keeps running during the fsync.
    FSYNC_WAL = "fsync-wal"
    # WriteOptions.sync=True: RocksDB fsyncs, but rocksdict holds the GIL meanwhile.
    ROCKSDB_SYNC = "rocksdb-sync"


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


@dataclass(slots=True)
class _Handles:
    """Everything that keeps RocksDB open; dropped together on close."""

    db: Any
    cfs: dict[str, Any] = field(default_factory=dict)
    handles: dict[str, Any] = field(default_factory=dict)
    direct_io: bool = False  # table files written past the page cache


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
        rocks: _Handles,
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
        self._rocks: _Handles | None = rocks
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
    ) -> EmbeddedDB:
        """Open (creating if needed) the data directory ``path``. ``partitions`` defaults
        to the directory's own count, or ``DEFAULT_PARTITIONS`` for a new one."""
        if partitions is not None and partitions < 1:
            raise ValueError(f"partitions must be at least 1, got {partitions}")
        data_dir = os.fspath(path)
        opened = await asyncio.to_thread(_open_sync, data_dir, partitions, durability)
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
            await asyncio.to_thread(_release, rocks, wal, lock_fd)
            raise
        log.info(
            "embedded data directory opened path=%s partitions=%d epoch=%d durability=%s "
            "direct_io=%s",
            data_dir,
            count,
            epoch,
            durability.value,
            "yes" if rocks.direct_io else "no (O_DIRECT is refused here or not available)",
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
        await asyncio.to_thread(_release, rocks, self._wal, self._lock_fd)
        self._executor.shutdown(wait=True)
        log.info("embedded data directory closed path=%s", self.path)

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
        failure = self._note_failure(_write_failure(self.path, exc))
        for queued in [*taken, *self._queue]:
            if not queued.done.done():
                queued.done.set_exception(type(failure)(str(failure)))
        self._queue = []

    def _read_failed(self, exc: Exception) -> StorageFailed:
        """A read failed (a damaged block): nothing read from here can be trusted."""
        if is_corruption(exc):
            failure: StorageFailed = _corrupted(self.path, exc)
        else:
            failure = StorageFailed(
                f"reading the embedded data directory {self.path} failed ({_detail(exc)}); "
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


def _detail(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _write_failure(path: str, exc: BaseException) -> StorageFailed:
    acknowledged = (
        f"every command acknowledged before it is stored in {path} and goes on from there; "
        "nothing after this write was acknowledged"
    )
    if is_disk_full(exc):
        return DiskFull(
            f"the disk holding the embedded data directory {path} is full ({_detail(exc)}); "
            f"stepstream stops: free space on that disk, then start it again: {acknowledged}"
        )
    if is_corruption(exc):
        return _corrupted(path, exc)
    return StorageFailed(
        f"writing to the embedded data directory {path} failed ({_detail(exc)}); "
        f"stepstream stops: fix the disk, then start it again: {acknowledged}"
    )


def _open_failure(path: str, exc: BaseException) -> StorageFailed:
    if is_disk_full(exc):
        return DiskFull(
            f"cannot open the embedded data directory {path}: the disk holding it is full "
            f"({_detail(exc)}); free space on that disk, then start again (what it holds "
            "is not lost)"
        )
    if is_corruption(exc) or is_missing_file(exc):
        return _corrupted(path, exc)
    return StorageFailed(f"cannot open the embedded data directory {path}: {_detail(exc)}")


def _corrupted(path: str, exc: BaseException | str) -> DataDirCorrupted:
    detail = exc if isinstance(exc, str) else _detail(exc)
    return DataDirCorrupted(
        f"the embedded data directory {path} is damaged ({detail}); stepstream "
        f"cannot use it. Restore it from a backup, or move it away (mv {path} "
        f"{path}.damaged) to start with an empty one: the instances it holds are then lost"
    )


def _check_write(
    appends: Sequence[Append],
    puts: Sequence[tuple[bytes, bytes]],
    deletes: Sequence[bytes],
    partitions: int,
) -> None:
    """Reject a malformed write in its caller, before it can share a batch with others."""
    for append in appends:
        keys.kind_code(append.kind)
        if append.partition is None or not 0 <= append.partition < partitions:
            raise ValueError(
                f"append to partition {append.partition} of {partitions}: resolve appends "
                "with EmbeddedLog.resolve first"
            )
        if type(append.key) is not bytes or type(append.value) is not bytes:
            raise TypeError(f"record key and value must be bytes: {append!r}")
    for key, value in puts:
        if type(key) is not bytes or type(value) is not bytes:
            raise TypeError(f"state key and value must be bytes: {key!r}={value!r}")
    for key in deletes:
        if type(key) is not bytes:
            raise TypeError(f"state key must be bytes: {key!r}")


def _open_sync(
    data_dir: str, partitions: int | None, durability: Durability
) -> tuple[_Handles, int, int, int, WalSync | None]:
    try:
        os.makedirs(data_dir, exist_ok=True)
        lock_fd = _lock(data_dir)
    except OSError as exc:
        raise _open_failure(data_dir, exc) from exc
    rocks: _Handles | None = None
    try:
        rocks = _open_rocks(data_dir)
        count, epoch = _claim(rocks, data_dir, partitions)
        wal = None
        if durability is Durability.FSYNC_WAL:
            wal = WalSync(os.path.join(data_dir, ROCKSDB_DIR))
        return rocks, lock_fd, count, epoch, wal
    except StepstreamError:
        _release(rocks, None, lock_fd)
        raise
    except Exception as exc:
        _release(rocks, None, lock_fd)
        raise _open_failure(data_dir, exc) from exc
    except BaseException:
        _release(rocks, None, lock_fd)
        raise


def _release(rocks: _Handles | None, wal: WalSync | None, lock_fd: int) -> None:
    """Close RocksDB (every handle that keeps it open), then give up the directory.

    Closing flushes, which fails after a failed write (RocksDB keeps the error): that is
    logged, and the directory is given up all the same."""
    try:
        if wal is not None:
            wal.close()
        if rocks is not None:
            rocks.handles.clear()
            for cf in rocks.cfs.values():
                _close_quietly(cf)
            rocks.cfs.clear()
            _close_quietly(rocks.db)
    finally:
        _unlock(lock_fd)


def _close_quietly(handle: Any) -> None:
    try:
        handle.close()
    except Exception as exc:
        log.warning("closing RocksDB failed (what was acknowledged is durable): %s", exc)


def _in_use(data_dir: str, holder: str = "") -> DataDirInUse:
    return DataDirInUse(
        f"data directory {data_dir} is in use by another stepstream process{holder}; "
        "stop it or pass another --data"
    )


def _lock(data_dir: str) -> int:
    fd = os.open(os.path.join(data_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise _in_use(data_dir, f" (pid {holder})" if holder.isdigit() else "") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _unlock(fd: int) -> None:
    # Closing the descriptor releases the flock; the file stays (unlinking it would race).
    os.close(fd)


def _open_rocks(data_dir: str) -> _Handles:
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.create_missing_column_families(True)
    options.set_keep_log_file_num(4)
    options.set_max_total_wal_size(rocks_helpers.MAX_TOTAL_WAL_BYTES)
    direct_io = rocks_helpers.direct_io_supported(data_dir)
    if direct_io:
        # Flushes and compactions write their table files past the page cache, a buffer
        # at a time. Through the cache, a table file (64 MB) went to the disk all at once
        # when RocksDB synced it, and the commits' WAL fsyncs queued behind it: measured
        # here, 100-300 ms stalls at every flush and compaction.
        options.set_use_direct_io_for_flush_and_compaction(True)
    # Every acknowledged write was fsynced, so only an unacknowledged one can be torn at
    # the end of the write-ahead log after a crash: that tail is dropped. Damage anywhere
    # else is an error, where RocksDB's default would replay the log up to the damage and
    # silently drop acknowledged writes after it.
    options.set_wal_recovery_mode(DBRecoveryMode.tolerate_corrupted_tail_records())
    families = {name: Options(raw_mode=True) for name in keys.COLUMN_FAMILIES}
    try:
        db = Rdict(os.path.join(data_dir, ROCKSDB_DIR), options, column_families=families)
    except Exception as exc:
        if "lock" in str(exc).lower() and not is_disk_full(exc):
            # Our flock is free, so the holder is this process: an earlier EmbeddedDB that
            # was not closed, or an iterator that outlived it.
            raise _in_use(data_dir, " (this process: close the earlier EmbeddedDB)") from exc
        raise _open_failure(data_dir, exc) from exc
    rocks = _Handles(db, direct_io=direct_io)
    for name in keys.COLUMN_FAMILIES:
        rocks.cfs[name] = db.get_column_family(name)
        rocks.handles[name] = db.get_column_family_handle(name)
    return rocks


def _claim(rocks: _Handles, data_dir: str, partitions: int | None) -> tuple[int, int]:
    """Check the directory's format and partition count, and bump the fencing epoch."""
    meta = rocks.cfs[keys.META_CF]
    stored_format: bytes | None = meta.get(keys.META_FORMAT)
    if stored_format is not None and keys.decode_u64(stored_format) != keys.FORMAT_VERSION:
        raise StorageFailed(
            f"data directory {data_dir} has embedded format {keys.decode_u64(stored_format)}; "
            f"this stepstream reads format {keys.FORMAT_VERSION}"
        )
    stored_count: bytes | None = meta.get(keys.META_PARTITIONS)
    if stored_count is None:
        count = DEFAULT_PARTITIONS if partitions is None else partitions
    else:
        count = keys.decode_u64(stored_count)
        if partitions is not None and partitions != count:
            raise PartitionCountMismatch(
                f"data directory {data_dir} was created with {count} partitions and cannot "
                f"be opened with {partitions}: pass --partitions {count}, or another --data"
            )
    stored_epoch: bytes | None = meta.get(keys.META_EPOCH)
    stored = 0 if stored_epoch is None else keys.decode_u64(stored_epoch)
    noted = _read_epoch_file(data_dir)
    if noted > stored:
        raise _corrupted(
            data_dir,
            f"its RocksDB files are back at open number {stored}, but it was opened "
            f"{noted} times ({EPOCH_FILE}): acknowledged writes are missing",
        )
    epoch = stored + 1
    batch = WriteBatch(raw_mode=True)
    handle = rocks.handles[keys.META_CF]
    batch.put(keys.META_FORMAT, keys.encode_u64(keys.FORMAT_VERSION), handle)
    batch.put(keys.META_PARTITIONS, keys.encode_u64(count), handle)
    batch.put(keys.META_EPOCH, keys.encode_u64(epoch), handle)
    sync = WriteOptions()
    sync.sync = True
    rocks.db.write(batch, sync)
    _write_epoch_file(data_dir, epoch)
    return count, epoch


def _read_epoch_file(data_dir: str) -> int:
    try:
        with open(os.path.join(data_dir, EPOCH_FILE)) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return 0  # a directory made before this file existed, or a torn write of it


def _write_epoch_file(data_dir: str, epoch: int) -> None:
    """Replace the file atomically and durably (after the epoch is durable in RocksDB,
    so a crash in between leaves the file behind, never ahead)."""
    path = os.path.join(data_dir, EPOCH_FILE)
    temporary = path + ".tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, f"{epoch}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    dir_fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _successor(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key that starts with ``prefix``."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        return None
    return trimmed[:-1] + bytes((trimmed[-1] + 1,))
