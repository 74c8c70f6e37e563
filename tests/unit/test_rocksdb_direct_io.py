"""The embedded backend's RocksDB writes its table files (flushes, compactions) with
direct I/O where the filesystem allows it, so a commit's WAL fsync does not queue behind
a whole table file going to the disk; where the filesystem refuses direct I/O, it opens
and works through the page cache as before."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from stepstream.consumers import rocks as rocks_helpers
from stepstream.consumers.embedded import EmbeddedDB, EmbeddedPartition, datadir
from stepstream.consumers.embedded import db as embedded_db
from stepstream.engine.seams import CommitBatch


def direct_io_option(data: Path) -> str:
    """The setting RocksDB wrote to the options file of its latest open."""
    rocks = data / datadir.ROCKSDB_DIR
    latest = max(rocks.glob("OPTIONS-*"), key=lambda f: int(f.name.split("-")[1]))
    for line in latest.read_text().splitlines():
        name, _, value = line.strip().partition("=")
        if name == "use_direct_io_for_flush_and_compaction":
            return value
    raise AssertionError(f"{latest.name} does not name use_direct_io_for_flush_and_compaction")


def table_files(data: Path) -> list[Path]:
    return list((data / datadir.ROCKSDB_DIR).glob("*.sst"))


async def write_and_flush(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commit 4 MB of state with a 1 MB cap on the WALs, which makes RocksDB flush it
    to table files."""
    monkeypatch.setattr(rocks_helpers, "MAX_TOTAL_WAL_BYTES", 1 << 20)
    db = await EmbeddedDB.open(data, 1)
    try:
        partition = EmbeddedPartition(db, 0)
        for n in range(8):
            batch = CommitBatch()
            for i in range(64):
                batch.put(f"k-{n}-{i}".encode(), bytes([n]) * 8192)
            await partition.commit(batch)
    finally:
        await db.close()


async def read_back(data: Path) -> None:
    db = await EmbeddedDB.open(data, 1)
    try:
        store = EmbeddedPartition(db, 0).store
        for n in range(8):
            assert store.get(f"k-{n}-63".encode()) == bytes([n]) * 8192
    finally:
        await db.close()


def test_the_probe_answers_for_the_directory_and_leaves_nothing_behind(tmp_path: Path) -> None:
    supported = rocks_helpers.direct_io_supported(str(tmp_path))
    try:
        fd = os.open(tmp_path / "own-probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        assert supported is False
    else:
        os.close(fd)
        assert supported is True
    assert sorted(p.name for p in tmp_path.iterdir()) == (["own-probe"] if supported else [])


def opened_line(caplog: pytest.LogCaptureFixture) -> str:
    """The open's line, its fields as key=value (they are fields, not in the message)."""
    lines = [r for r in caplog.records if r.getMessage() == "embedded data directory opened"]
    assert lines, "the open was not logged"
    fields = ("path", "partitions", "epoch", "durability", "direct_io")
    return " ".join(f"{name}={getattr(lines[-1], name)}" for name in fields)


async def test_table_files_are_written_with_direct_io_where_the_filesystem_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=embedded_db.log.name)
    data = tmp_path / "data"
    data.mkdir()
    if not rocks_helpers.direct_io_supported(str(data)):
        pytest.fail(f"this test needs a filesystem with O_DIRECT under {tmp_path}")
    await write_and_flush(data, monkeypatch)
    assert direct_io_option(data) == "true"
    assert "direct_io=yes" in opened_line(caplog)
    assert table_files(data), "nothing was flushed: the test wrote too little"
    await read_back(data)  # what direct I/O wrote reads back after a reopen


async def test_a_filesystem_that_refuses_direct_io_gets_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=embedded_db.log.name)
    real_open = os.open

    def refusing_open(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", refusing_open)
    data = tmp_path / "data"
    await write_and_flush(data, monkeypatch)
    assert direct_io_option(data) == "false"
    assert "direct_io=no (O_DIRECT is refused here or not available)" in opened_line(caplog)
    assert table_files(data)
    await read_back(data)
