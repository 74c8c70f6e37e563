"""The process's RocksDB memory budget: one block cache and one write buffer manager,
shared by every RocksDB the process opens (the embedded data directory, or each
partition's state on a Kafka worker).

Left to RocksDB's defaults, every column family of every database has its own block
cache (32 MB) and its own memtables (64 MB each, two before a flush stalls), so memory
grows with the number of partitions a worker holds and with what was written lately:
measured, a Kafka worker with a million pending timers kept 0.97 GB resident, and an
embedded engine grew by 170 MB over 100,000 short instances that retention had already
forgotten. Here the memtables of all of them are charged to the one cache, and flushed
once they hold half of it, so RocksDB's memory stays near the budget whatever the
partition count. Index and filter blocks live in the cache too (pinned for level 0, the
blocks every read consults), rather than beside it without a bound.

The budget is ``STEPSTREAM_ROCKSDB_MEMORY_MB`` (default 64): raise it for a worker with
much state that reads more than it writes; lower it on a small machine.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from rocksdict import BlockBasedOptions, Cache, Options, WriteBufferManager

from stepstream.engine.config.environ import env_int

ENV = "STEPSTREAM_ROCKSDB_MEMORY_MB"
DEFAULT_MB = 64
MIN_MB = 8
# The share of the budget the memtables may hold before RocksDB flushes one.
_WRITE_BUFFER_SHARE = 0.5


@dataclass(frozen=True)
class RocksMemory:
    """How much memory the process's RocksDB databases may use together (MB)."""

    total_mb: int = DEFAULT_MB

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RocksMemory:
        return cls(env_int(env, ENV, DEFAULT_MB, minimum=MIN_MB))

    @property
    def total_bytes(self) -> int:
        return self.total_mb << 20

    def apply(self, db_options: Options, families: Mapping[str, Options]) -> None:
        """Make a database opened with these options (``db_options`` for the database and
        its default column family, ``families`` for the others) use the shared budget."""
        pool = _pool(self.total_bytes)
        db_options.set_write_buffer_manager(pool.write_buffers)
        for options in (db_options, *families.values()):
            options.set_block_based_table_factory(pool.table_options())


class _Pool:
    def __init__(self, total_bytes: int) -> None:
        self.cache = Cache(total_bytes)
        self.write_buffers = WriteBufferManager.new_write_buffer_manager_with_cache(
            int(total_bytes * _WRITE_BUFFER_SHARE), False, self.cache
        )

    def table_options(self) -> BlockBasedOptions:
        table = BlockBasedOptions()
        table.set_block_cache(self.cache)
        table.set_cache_index_and_filter_blocks(True)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        return table


# One pool per budget size, for the life of the process: databases opened with the same
# budget share it (a process normally has one).
_POOLS: dict[int, _Pool] = {}
_POOLS_LOCK = threading.Lock()  # databases are opened on worker threads


def _pool(total_bytes: int) -> _Pool:
    with _POOLS_LOCK:
        pool = _POOLS.get(total_bytes)
        if pool is None:
            pool = _POOLS[total_bytes] = _Pool(total_bytes)
        return pool


def usage_bytes() -> int:
    """What the process's RocksDB databases hold now within their budget: cached blocks,
    and the memtables charged to the cache."""
    with _POOLS_LOCK:
        return sum(pool.cache.get_usage() for pool in _POOLS.values())


def limit_bytes() -> int:
    """The process's RocksDB budget (0 before a database is opened)."""
    with _POOLS_LOCK:
        return sum(_POOLS)
