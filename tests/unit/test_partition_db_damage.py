"""A Kafka worker's partition state that RocksDB finds damaged: found on a read (told
once, through ``on_corrupt``), noted next to the directory while it is open, and moved
aside the next time it is opened, leaving an empty state to rebuild from the topics."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stepstream.consumers.kafka.db import (
    PartitionDB,
    StateCorrupted,
    mark_damaged,
    needs_quarantine,
    quarantine,
)
from stepstream.consumers.kafka.runner import KafkaRunner, _open_sound
from stepstream.consumers.kafka.state_dir import StateDir
from stepstream.consumers.rocks_memory import RocksMemory
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.seams import SystemClock
from stepstream.engine.wire.serde import default_serde


def _filled(path: Path) -> None:
    db = PartitionDB.open(str(path), 0, 2)
    db.write(puts=[(b"k%05d" % i, b"v" * 100) for i in range(2000)], offsets={"history": 7})
    db._db.flush()
    db.close()


def _damage_first_block(path: Path) -> None:
    table = max(path.glob("*.sst"), key=lambda f: f.stat().st_size)
    with open(table, "r+b") as f:
        f.seek(16)
        f.write(os.urandom(64))


def test_a_damaged_block_is_reported_once_and_raised_on_every_read(tmp_path: Path) -> None:
    path = tmp_path / "partition-0"
    _filled(path)
    _damage_first_block(path)
    db = PartitionDB.open(str(path), 0, 2)  # RocksDB reads data blocks only when asked
    told: list[StateCorrupted] = []
    db.on_corrupt = told.append
    try:
        with pytest.raises(StateCorrupted, match=r"partition=0 state in .* is damaged"):
            db.get(b"k00000")
        with pytest.raises(StateCorrupted):
            list(db.scan(b"k"))  # not a scan that ends early and says nothing
        assert len(told) == 1 and told[0].path == str(path)
    finally:
        db.close()


def test_a_directory_rocksdb_cannot_open_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "partition-0"
    _filled(path)
    (path / "CURRENT").write_text("MANIFEST-999999\n")
    with pytest.raises(StateCorrupted):
        PartitionDB.open(str(path), 0, 2)
    db = _open_sound(str(path), 0, 2, RocksMemory())
    try:
        assert db.empty and db.offset("history") is None
    finally:
        db.close()
    (aside,) = tmp_path.glob("partition-0.corrupt-*")
    assert (aside / "CURRENT").read_text() == "MANIFEST-999999\n"  # kept for a post-mortem


def test_a_directory_marked_damaged_while_open_is_moved_aside_when_next_opened(
    tmp_path: Path,
) -> None:
    path = tmp_path / "partition-0"
    _filled(path)
    mark_damaged(str(path), "partition=0 state is damaged (found by a read)")
    assert needs_quarantine(str(path)) == "partition=0 state is damaged (found by a read)"
    db = _open_sound(str(path), 0, 2, RocksMemory())  # RocksDB itself would open it
    try:
        assert db.empty
    finally:
        db.close()
    (aside,) = tmp_path.glob("partition-0.corrupt-*")
    assert (aside / "DAMAGED").read_text().startswith("partition=0 state is damaged")
    assert needs_quarantine(str(path)) is None
    assert quarantine(str(tmp_path / "partition-9"), "nothing there") is None


def test_damage_found_while_running_stops_the_worker_and_marks_the_directory(
    tmp_path: Path,
) -> None:
    state_dir = StateDir.claim(tmp_path, "p")
    fatal: list[BaseException] = []
    try:
        runner = KafkaRunner(
            KafkaSettings.load("127.0.0.1:9", "p", environ={}),
            host=None,  # type: ignore[arg-type]
            state_dir=state_dir,
            producer=None,  # type: ignore[arg-type]
            serde=default_serde(),
            clock=SystemClock(),
            on_owned=None,  # type: ignore[arg-type]
            on_fatal=fatal.append,
        )
        path = state_dir.partition_path(1)
        damage = StateCorrupted(path, 1, "Corruption: block checksum mismatch")
        runner._corrupt_found(damage)
        assert fatal == [damage]
        assert needs_quarantine(path) == str(damage)
    finally:
        state_dir.release()
