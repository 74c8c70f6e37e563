"""RocksDB's write-ahead logs: an embedded commit fsyncs only the WAL that grew since
its last sync, and the WALs kept on disk (embedded, and under a Kafka partition's state)
stay near ``max_total_wal_size`` however rarely a column family is written."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest

from stepstream.consumers import rocks as rocks_helpers
from stepstream.consumers.embedded import EmbeddedDB, EmbeddedPartition, datadir
from stepstream.consumers.embedded.wal import WalSync
from stepstream.engine.seams import CommitBatch


def test_only_a_wal_that_grew_since_its_last_sync_is_synced_again(tmp_path: Path) -> None:
    for n in range(3):
        (tmp_path / f"00000{n}.log").write_bytes(b"record")
    (tmp_path / "000001.sst").write_bytes(b"table")  # not a WAL
    wal = WalSync(str(tmp_path))
    try:
        wal.sync()
        assert wal.fsyncs == 3  # every WAL is new
        wal.sync()
        assert wal.fsyncs == 3  # nothing written since
        with open(tmp_path / "000002.log", "ab") as current:
            current.write(b"another record")
        wal.sync()
        assert wal.fsyncs == 4  # the one that grew
        (tmp_path / "000000.log").unlink()  # flushed and deleted by RocksDB
        (tmp_path / "000003.log").write_bytes(b"new")
        wal.sync()
        assert wal.fsyncs == 5
    finally:
        wal.close()


def wal_bytes(rocks: Path) -> int:
    """The size of the WALs in a RocksDB directory (one RocksDB deletes between the
    listing and its size, in the background, counts as gone)."""
    total = 0
    for f in rocks.iterdir():
        if f.name.endswith(".log"):
            with contextlib.suppress(FileNotFoundError):
                total += f.stat().st_size
    return total


async def test_wals_on_disk_stay_near_the_cap_while_state_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rocks_helpers, "MAX_TOTAL_WAL_BYTES", 1 << 20)
    data = tmp_path / "data"
    rocks = data / datadir.ROCKSDB_DIR
    db = await EmbeddedDB.open(data, 1)
    try:
        partition = EmbeddedPartition(db, 0)
        for n in range(32):  # 16 MB of state; the meta column family is not written
            batch = CommitBatch()
            for i in range(64):
                batch.put(f"k-{n}-{i}".encode(), os.urandom(8192))
            await partition.commit(batch)
        for _ in range(400):  # the forced flushes run in the background
            if wal_bytes(rocks) <= 6 << 20:
                break
            await asyncio.sleep(0.05)
        assert wal_bytes(rocks) <= 6 << 20
        assert partition.store.get(b"k-0-0") is not None
    finally:
        await db.close()


def test_a_kafka_partitions_state_keeps_its_wals_near_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from stepstream.consumers.kafka.db import PartitionDB

    monkeypatch.setattr(rocks_helpers, "MAX_TOTAL_WAL_BYTES", 1 << 20)
    path = tmp_path / "p0"
    db = PartitionDB.open(str(path), 0, 4)
    try:
        for n in range(32):  # 16 MB of state, each write with its offsets in the meta family
            puts = [(f"k-{n}-{i}".encode(), os.urandom(8192)) for i in range(64)]
            db.write(puts=puts, offsets={"commands": n + 1})
            time.sleep(0.01)  # a worker's commits are spread out; flushes run meanwhile
        for _ in range(400):
            if wal_bytes(path) <= 6 << 20:
                break
            time.sleep(0.05)
        assert wal_bytes(path) <= 6 << 20
        assert db.offset("commands") == 32
    finally:
        db.close()
