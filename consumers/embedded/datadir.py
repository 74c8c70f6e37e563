"""Opening the embedded data directory: the process lock, RocksDB with its options, the
check of format and partition count, the fencing epoch (in RocksDB and in a file beside
it), and storage failures turned into errors that say what to do."""

from __future__ import annotations

import enum
import fcntl
import logging
import os
from dataclasses import dataclass, field
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
from stepstream.consumers.embedded.wal import WalSync
from stepstream.consumers.rocks import is_corruption, is_disk_full, is_missing_file
from stepstream.consumers.rocks_memory import RocksMemory
from stepstream.engine.errors import StepstreamError

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


@dataclass(slots=True)
class Handles:
    """Everything that keeps RocksDB open; dropped together on close."""

    db: Any
    cfs: dict[str, Any] = field(default_factory=dict)
    handles: dict[str, Any] = field(default_factory=dict)
    direct_io: bool = False  # table files written past the page cache


def detail(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def write_failure(path: str, exc: BaseException) -> StorageFailed:
    acknowledged = (
        f"every command acknowledged before it is stored in {path} and goes on from there; "
        "nothing after this write was acknowledged"
    )
    if is_disk_full(exc):
        return DiskFull(
            f"the disk holding the embedded data directory {path} is full ({detail(exc)}); "
            f"stepstream stops: free space on that disk, then start it again: {acknowledged}"
        )
    if is_corruption(exc):
        return corrupted(path, exc)
    return StorageFailed(
        f"writing to the embedded data directory {path} failed ({detail(exc)}); "
        f"stepstream stops: fix the disk, then start it again: {acknowledged}"
    )


def _open_failure(path: str, exc: BaseException) -> StorageFailed:
    if is_disk_full(exc):
        return DiskFull(
            f"cannot open the embedded data directory {path}: the disk holding it is full "
            f"({detail(exc)}); free space on that disk, then start again (what it holds "
            "is not lost)"
        )
    if is_corruption(exc) or is_missing_file(exc):
        return corrupted(path, exc)
    return StorageFailed(f"cannot open the embedded data directory {path}: {detail(exc)}")


def corrupted(path: str, exc: BaseException | str) -> DataDirCorrupted:
    what = exc if isinstance(exc, str) else detail(exc)
    return DataDirCorrupted(
        f"the embedded data directory {path} is damaged ({what}); stepstream "
        f"cannot use it. Restore it from a backup, or move it away (mv {path} "
        f"{path}.damaged) to start with an empty one: the instances it holds are then lost"
    )


def open_data_dir(
    data_dir: str, partitions: int | None, durability: Durability, memory: RocksMemory
) -> tuple[Handles, int, int, int, WalSync | None]:
    try:
        os.makedirs(data_dir, exist_ok=True)
        lock_fd = _lock(data_dir)
    except OSError as exc:
        raise _open_failure(data_dir, exc) from exc
    rocks: Handles | None = None
    try:
        rocks = _open_rocks(data_dir, memory)
        count, epoch = _claim(rocks, data_dir, partitions)
        wal = None
        if durability is Durability.FSYNC_WAL:
            wal = WalSync(os.path.join(data_dir, ROCKSDB_DIR))
        return rocks, lock_fd, count, epoch, wal
    except StepstreamError:
        release(rocks, None, lock_fd)
        raise
    except Exception as exc:
        release(rocks, None, lock_fd)
        raise _open_failure(data_dir, exc) from exc
    except BaseException:
        release(rocks, None, lock_fd)
        raise


def release(rocks: Handles | None, wal: WalSync | None, lock_fd: int) -> None:
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
        "stop it, or give another directory (--data, or --connect embedded:DIR); while "
        "`stepstream dev` serves it, connect to that instead (--connect http://...)"
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


def _open_rocks(data_dir: str, memory: RocksMemory) -> Handles:
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
    memory.apply(options, families)
    try:
        db = Rdict(os.path.join(data_dir, ROCKSDB_DIR), options, column_families=families)
    except Exception as exc:
        if "lock" in str(exc).lower() and not is_disk_full(exc):
            # Our flock is free, so the holder is this process: an earlier EmbeddedDB that
            # was not closed, or an iterator that outlived it.
            raise _in_use(data_dir, " (this process: close the earlier EmbeddedDB)") from exc
        raise _open_failure(data_dir, exc) from exc
    rocks = Handles(db, direct_io=direct_io)
    for name in keys.COLUMN_FAMILIES:
        rocks.cfs[name] = db.get_column_family(name)
        rocks.handles[name] = db.get_column_family_handle(name)
    return rocks


def _claim(rocks: Handles, data_dir: str, partitions: int | None) -> tuple[int, int]:
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
        raise corrupted(
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
