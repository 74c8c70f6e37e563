"""The embedded backend: the durable log, per-partition state, atomic group commits, and
surviving kill -9."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import pytest

from stepstream.consumers.embedded import (
    DataDirInUse,
    Durability,
    EmbeddedDB,
    EmbeddedPartition,
    PartitionCountMismatch,
    StorageFailed,
)
from stepstream.engine.seams import Append, CommitBatch, LogEntry, PartitionBackend
from stepstream.engine.wire.topics import COMMANDS, DEAD_LETTERS, HISTORY, TIMERS, partition_for

REPO = Path(__file__).resolve().parents[2]

OpenDB = Callable[..., Awaitable[EmbeddedDB]]


@pytest.fixture(params=list(Durability), ids=[mode.value for mode in Durability])
def durability(request: pytest.FixtureRequest) -> Durability:
    mode: Durability = request.param
    return mode


@pytest.fixture
async def open_db(tmp_path: Path, durability: Durability) -> AsyncIterator[OpenDB]:
    """Open the test's data directory (again); every db still open is closed at the end."""
    opened: list[EmbeddedDB] = []

    async def _open(partitions: int | None = 4, path: Path | None = None) -> EmbeddedDB:
        db = await EmbeddedDB.open(path or tmp_path / "data", partitions, durability=durability)
        opened.append(db)
        return db

    yield _open
    for db in opened:
        await db.close()


def _values(entries: Sequence[LogEntry]) -> list[bytes]:
    return [entry.value for entry in entries]


async def test_append_read_dense_offsets_across_reopen(open_db: OpenDB) -> None:
    db = await open_db()
    first = await db.log.append([Append(COMMANDS, b"x", b"a%d" % i, 2) for i in range(5)])
    assert first == [(2, i) for i in range(5)]
    await db.close()

    db = await open_db()
    assert db.log.end_offset(COMMANDS, 2) == 5
    assert db.log.end_offset(COMMANDS, 1) == 0
    assert await db.log.append([Append(COMMANDS, b"x", b"a5", 2)]) == [(2, 5)]
    entries = db.log.read(COMMANDS, 2, 0, 100)
    assert [e.offset for e in entries] == list(range(6))
    assert _values(entries) == [b"a%d" % i for i in range(6)]
    assert all(e.key == b"x" and e.partition == 2 and e.topic == COMMANDS for e in entries)
    assert [e.offset for e in db.log.read(COMMANDS, 2, 3, 2)] == [3, 4]
    assert db.log.read(COMMANDS, 2, 6, 10) == []


async def test_append_without_partition_uses_the_key_partitioner(open_db: OpenDB) -> None:
    db = await open_db(partitions=4)
    ids = [f"order-{i}" for i in range(20)]
    positions = await db.log.append([Append(COMMANDS, i.encode(), b"v") for i in ids])
    assert [p for p, _ in positions] == [partition_for(i, 4) for i in ids]


async def test_keys_and_values_round_trip_exactly(open_db: OpenDB) -> None:
    db = await open_db()
    key = bytes(range(256)) * 3  # longer than one varint byte, every byte value
    records = [Append(HISTORY, key, b""), Append(HISTORY, b"", b"\x00\xff" * 500)]
    await db.log.append([Append(a.kind, a.key, a.value, 0) for a in records])
    entries = db.log.read(HISTORY, 0, 0, 10)
    assert [(e.key, e.value) for e in entries] == [(a.key, a.value) for a in records]


async def test_unknown_kind_and_partition_are_rejected(open_db: OpenDB) -> None:
    db = await open_db(partitions=4)
    with pytest.raises(ValueError, match="unknown topic kind"):
        await db.log.append([Append("nope", b"k", b"v")])
    with pytest.raises(ValueError, match="out of range"):
        await db.log.append([Append(COMMANDS, b"k", b"v", 4)])
    with pytest.raises(ValueError, match="out of range"):
        EmbeddedPartition(db, 4)


async def test_commit_applies_appends_state_and_offsets_together(open_db: OpenDB) -> None:
    db = await open_db()
    await db.log.append([Append(COMMANDS, b"i-1", b"start", 1), Append(COMMANDS, b"i-1", b"go", 1)])
    part = EmbeddedPartition(db, 1)
    part_backend: PartitionBackend = part  # the seam is satisfied
    assert part_backend.partition == 1
    assert part.committed_offset(COMMANDS) == 0
    assert (part.partition, part.partitions, part.epoch) == (1, 4, db.epoch)

    batch = CommitBatch()
    batch.appends.append(Append(HISTORY, b"i-1", b"WorkflowStarted", 1))
    batch.appends.append(Append(TIMERS, b"i-1", b"TimerScheduled", 1))
    batch.put(b"inst/i-1", b"running")
    batch.put(b"gone", b"x")
    batch.offsets[COMMANDS] = 2
    await part.commit(batch)

    def check(db: EmbeddedDB) -> None:
        part = EmbeddedPartition(db, 1)
        assert part.committed_offset(COMMANDS) == 2
        assert part.store.get(b"inst/i-1") == b"running"
        assert _values(db.log.read(HISTORY, 1, 0, 10)) == [b"WorkflowStarted"]
        assert _values(db.log.read(TIMERS, 1, 0, 10)) == [b"TimerScheduled"]

    check(db)
    await db.close()
    db = await open_db()
    check(db)

    part = EmbeddedPartition(db, 1)
    batch = CommitBatch()
    batch.delete(b"gone")
    batch.put(b"inst/i-1", b"completed")
    await part.commit(batch)
    assert part.store.get(b"gone") is None
    assert part.store.get(b"inst/i-1") == b"completed"
    assert part.committed_offset(COMMANDS) == 2  # offsets not in the batch stay


async def test_rejected_commit_writes_nothing(open_db: OpenDB) -> None:
    db = await open_db()
    part = EmbeddedPartition(db, 0)
    before = db.batches_written

    batch = CommitBatch(appends=[Append(HISTORY, b"i", b"h", 0)], offsets={COMMANDS: 1})
    batch.put(b"k", b"v")
    with pytest.raises(ValueError, match="log ends at 0"):
        await part.commit(batch)
    bad_kind = CommitBatch(appends=[Append(HISTORY, b"i", b"h", 0), Append("bogus", b"i", b"x")])
    with pytest.raises(ValueError, match="unknown topic kind"):
        await part.commit(bad_kind)

    not_bytes = CommitBatch()
    not_bytes.put(b"k", "v")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be bytes"):
        await part.commit(not_bytes)

    assert db.batches_written == before
    assert part.store.get(b"k") is None
    assert db.log.end_offset(HISTORY, 0) == 0
    # The writer is still serving.
    assert await db.log.append([Append(HISTORY, b"i", b"h", 0)]) == [(0, 0)]


async def test_partitions_do_not_see_each_others_state(open_db: OpenDB) -> None:
    db = await open_db()
    await db.log.append([Append(COMMANDS, b"k", b"v", 0)] * 3)
    zero, one = EmbeddedPartition(db, 0), EmbeddedPartition(db, 1)
    for part, tag in ((zero, b"0"), (one, b"1")):
        batch = CommitBatch()
        for key in (b"a/2", b"a/1", b"b/1", b"a/10"):
            batch.put(key, tag + key)
        await part.commit(batch)
    await zero.commit(CommitBatch(offsets={COMMANDS: 3}))

    assert zero.store.get(b"a/1") == b"0a/1"
    assert one.store.get(b"a/1") == b"1a/1"
    assert list(zero.store.scan(b"a/")) == [
        (b"a/1", b"0a/1"),
        (b"a/10", b"0a/10"),
        (b"a/2", b"0a/2"),
    ]
    assert [k for k, _ in one.store.scan(b"")] == [b"a/1", b"a/10", b"a/2", b"b/1"]
    assert list(EmbeddedPartition(db, 2).store.scan(b"")) == []
    assert zero.committed_offset(COMMANDS) == 3
    assert one.committed_offset(COMMANDS) == 0
    # A committed offset is not state: it never shows up in a scan.
    assert all(not k.startswith(b"o") for k, _ in zero.store.scan(b""))


async def test_group_commit_merges_concurrent_writes(open_db: OpenDB) -> None:
    db = await open_db()
    before = db.batches_written
    writes = [db.log.append([Append(HISTORY, b"k", b"%d" % i, 3)]) for i in range(1000)]
    positions = await asyncio.gather(*writes)

    fsyncs = db.batches_written - before
    assert fsyncs < 50, f"1000 concurrent writes took {fsyncs} fsyncs"
    assert db.writes_committed >= 1000
    # Offsets are dense and follow the order the writes were queued in.
    assert [pos for [pos] in positions] == [(3, i) for i in range(1000)]
    assert _values(db.log.read(HISTORY, 3, 0, 2000)) == [b"%d" % i for i in range(1000)]


async def test_partitions_appending_to_one_log_partition_never_collide(open_db: OpenDB) -> None:
    db = await open_db()

    async def dead_letter(partition: int, n: int) -> None:
        part = EmbeddedPartition(db, partition)
        for i in range(n):
            letter = Append(DEAD_LETTERS, b"p%d" % partition, b"%d:%d" % (partition, i), 0)
            await part.commit(CommitBatch(appends=[letter]))

    await asyncio.gather(*(dead_letter(p, 25) for p in range(4)))
    entries = db.log.read(DEAD_LETTERS, 0, 0, 1000)
    assert [e.offset for e in entries] == list(range(100))
    assert sorted(_values(entries)) == sorted(
        b"%d:%d" % (p, i) for p in range(4) for i in range(25)
    )


async def test_source_starts_at_committed_offset_and_advances(open_db: OpenDB) -> None:
    db = await open_db()
    await db.log.append([Append(COMMANDS, b"k", b"c%d" % i, 0) for i in range(5)])
    part = EmbeddedPartition(db, 0)
    await part.commit(CommitBatch(offsets={COMMANDS: 2}))
    source = part.source(COMMANDS)
    assert _values(await source.fetch(2, 0.0)) == [b"c2", b"c3"]
    assert _values(await source.fetch(10, 0.0)) == [b"c4"]
    started = time.monotonic()
    assert await source.fetch(10, 0.2) == []
    assert 0.15 <= time.monotonic() - started < 2.0
    # The source's position is in memory only: a new source resumes from the commit.
    assert _values(await part.source(COMMANDS).fetch(1, 0.0)) == [b"c2"]


async def test_waiting_reader_is_woken_by_an_append_without_polling(open_db: OpenDB) -> None:
    db = await open_db()
    part = EmbeddedPartition(db, 2)
    source = part.source(COMMANDS)
    reads = 0
    real_read = db.log.read

    def counting_read(kind: str, partition: int, offset: int, max_records: int) -> list[LogEntry]:
        nonlocal reads
        reads += 1
        return real_read(kind, partition, offset, max_records)

    db.log.read = counting_read  # type: ignore[method-assign]
    fetch = asyncio.create_task(source.fetch(10, 30.0))
    await asyncio.sleep(0.3)
    assert not fetch.done()
    assert reads == 1  # one look before waiting, none while waiting
    # Records for another partition or another kind do not wake it up.
    await db.log.append([Append(COMMANDS, b"k", b"other", 1), Append(HISTORY, b"k", b"h", 2)])
    await asyncio.sleep(0.05)
    assert not fetch.done()

    appended = time.monotonic()
    await db.log.append([Append(COMMANDS, b"k", b"wake", 2)])
    entries = await asyncio.wait_for(fetch, 5.0)
    assert time.monotonic() - appended < 0.5
    assert _values(entries) == [b"wake"]
    assert reads == 2


async def test_wait_times_out_and_close_wakes_waiters(open_db: OpenDB) -> None:
    db = await open_db()
    assert await db.log.wait(COMMANDS, 0, 0, 0.05) is False
    waiter = asyncio.create_task(db.log.wait(COMMANDS, 0, 0, 30.0))
    await asyncio.sleep(0.05)
    await db.close()
    assert await asyncio.wait_for(waiter, 5.0) is False


async def test_epoch_increments_on_every_open(open_db: OpenDB) -> None:
    epochs = []
    for _ in range(3):
        db = await open_db()
        epochs.append(db.epoch)
        assert EmbeddedPartition(db, 0).epoch == db.epoch
        await db.close()
    assert epochs == [1, 2, 3]


async def test_reopening_with_another_partition_count_fails_clearly(
    open_db: OpenDB, tmp_path: Path
) -> None:
    db = await open_db(partitions=4)
    await db.close()
    with pytest.raises(PartitionCountMismatch) as err:
        await open_db(partitions=8)
    message = str(err.value)
    assert str(tmp_path / "data") in message
    assert "created with 4 partitions" in message and "--partitions 4" in message
    # Without a count, the directory's own is used; the failed open left it usable.
    db = await open_db(partitions=None)
    assert db.partitions == 4


async def test_second_open_of_a_locked_directory_fails_clearly(
    open_db: OpenDB, tmp_path: Path
) -> None:
    await open_db()
    with pytest.raises(DataDirInUse) as err:
        await open_db()
    assert f"data directory {tmp_path / 'data'} is in use by another stepstream process" in str(
        err.value
    )
    assert "give another directory (--data, or --connect embedded:DIR)" in str(err.value)


async def test_another_process_cannot_open_a_locked_directory(tmp_path: Path) -> None:
    path = tmp_path / "data"
    script = (
        "import asyncio, sys\n"
        "from consumers.embedded import EmbeddedDB, DataDirInUse\n"
        "try:\n"
        f"    asyncio.run(EmbeddedDB.open({str(path)!r}))\n"
        "except DataDirInUse as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
    )
    async with await EmbeddedDB.open(path):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, env=_child_env(), stdout=asyncio.subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 3, out
    assert f"data directory {path} is in use by another stepstream process (pid {os.getpid()})" in (
        out.decode()
    )


async def test_a_failed_write_fails_everything_after_it(open_db: OpenDB) -> None:
    db = await open_db()
    await db.log.append([Append(COMMANDS, b"k", b"ok", 0)])

    def broken_disk(batch: object) -> None:
        raise OSError(5, "Input/output error")

    db._write_durably = broken_disk  # type: ignore[method-assign]
    with pytest.raises(StorageFailed, match="fix the disk"):
        await db.log.append([Append(COMMANDS, b"k", b"lost", 0)])
    with pytest.raises(StorageFailed):
        await db.log.append([Append(COMMANDS, b"k", b"refused", 0)])
    assert db.log.end_offset(COMMANDS, 0) == 1


# A worker in miniature: a producer appends commands; one processor per partition consumes
# them and commits, per fetch, one history record per command, a count, one state key per
# command and the consumed offset. It prints each acknowledgement as it gets it.
_CHILD = r"""
import asyncio, sys
from stepstream.consumers.embedded import Durability, EmbeddedDB, EmbeddedPartition
from stepstream.engine.seams import Append, CommitBatch
from stepstream.engine.wire.topics import COMMANDS, HISTORY

async def main(path, durability):
    db = await EmbeddedDB.open(path, partitions=4, durability=Durability(durability))
    print(f"epoch {db.epoch}", flush=True)

    async def produce():
        i = 0
        while True:
            p = i % 4
            value = b"%d:%d" % (db.epoch, i)
            [(part, offset)] = await db.log.append([Append(COMMANDS, b"i-%d" % p, value, p)])
            print(f"A {part} {offset}", flush=True)
            i += 1

    async def process(p):
        part = EmbeddedPartition(db, p)
        source = part.source(COMMANDS)
        count = int(part.store.get(b"count") or b"0")
        while True:
            entries = await source.fetch(16, 1.0)
            if not entries:
                continue
            batch = CommitBatch()
            for entry in entries:
                batch.appends.append(Append(HISTORY, entry.key, b"h:" + entry.value, p))
                batch.put(b"cmd/%012d" % entry.offset, entry.value)
            count += len(entries)
            batch.put(b"count", b"%d" % count)
            batch.offsets[COMMANDS] = entries[-1].offset + 1
            await part.commit(batch)
            print(f"C {p} {entries[-1].offset}", flush=True)

    await asyncio.gather(produce(), *(process(p) for p in range(4)))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _child_env() -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": pythonpath}


async def _run_and_kill(
    script: Path, path: Path, durability: Durability, min_acks: int
) -> tuple[int, list[str]]:
    """Start the child, let it acknowledge at least ``min_acks`` writes, kill -9 it
    mid-stream; return its epoch and every line it printed."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        str(path),
        durability.value,
        env=_child_env(),
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        first = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert first.startswith(b"epoch "), f"child did not start: {first!r}"
        epoch = int(first.split()[1])
        while len(lines) < min_acks:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, f"child exited early with {await proc.wait()} after {lines[-5:]}"
            lines.append(line.decode())
        await asyncio.sleep(random.uniform(0, 0.05))
        proc.send_signal(signal.SIGKILL)
        rest, _ = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == -signal.SIGKILL
    tail = rest.decode().split("\n")
    lines.extend(line + "\n" for line in tail[:-1])  # tail[-1]: a line cut by the kill, or ""
    return epoch, lines


def _check_consistent(db: EmbeddedDB, lines: list[str]) -> tuple[int, int]:
    """Every acknowledged write is there and no commit is half-applied."""
    appended = {p: -1 for p in range(4)}
    committed = {p: -1 for p in range(4)}
    for line in lines:
        tag, partition, offset = line.split()
        acks = appended if tag == "A" else committed
        acks[int(partition)] = max(acks[int(partition)], int(offset))
    commands_total = processed_total = 0
    for p in range(4):
        part = EmbeddedPartition(db, p)
        commands = db.log.read(COMMANDS, p, 0, 1_000_000)
        assert [c.offset for c in commands] == list(range(len(commands)))
        assert appended[p] < len(commands), f"partition {p} lost acknowledged command"
        done = part.committed_offset(COMMANDS)
        assert committed[p] < done, f"partition {p} lost an acknowledged commit"
        assert done <= len(commands)
        history = db.log.read(HISTORY, p, 0, 1_000_000)
        assert [h.value for h in history] == [b"h:" + c.value for c in commands[:done]], (
            f"partition {p}: history does not match commands 0..{done}"
        )
        assert part.store.get(b"count") == (b"%d" % done if done else None)
        state = list(part.store.scan(b"cmd/"))
        assert state == [(b"cmd/%012d" % c.offset, c.value) for c in commands[:done]]
        commands_total += len(commands)
        processed_total += done
    return commands_total, processed_total


@pytest.mark.slow
async def test_kill_9_loses_no_acknowledged_write_and_applies_no_commit_by_half(
    tmp_path: Path, durability: Durability
) -> None:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    path = tmp_path / "data"
    seen = 0
    acknowledged: list[str] = []
    next_epoch = 1
    for _ in range(5):
        min_acks = random.randint(100, 1500)
        epoch, lines = await _run_and_kill(script, path, durability, min_acks)
        assert epoch == next_epoch
        acknowledged.extend(lines)
        async with await EmbeddedDB.open(path, 4) as db:
            assert db.epoch == epoch + 1
            next_epoch = db.epoch + 1
            total, processed = _check_consistent(db, acknowledged)
        assert total > seen, "the restarted child made no progress"
        seen = total
        assert processed > 0


async def test_a_graceful_stop_lets_a_running_step_finish(tmp_path: Path, ledger: Path) -> None:
    """Closing the engine (Ctrl-C, SIGTERM of `stepstream dev`) drains: the attempt that
    is running finishes and is recorded, so a single-attempt step survives a restart."""
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from stepstream.producers.client import Client
    from tests.conftest import test_registry
    from tests.workflows import ledger_count

    config = EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    engine = await open_embedded(test_registry(), config)
    client = Client(engine.make_transport())
    await client.start("long-step", {"name": "g", "seconds": 0.5, "max": 1}, instance_id="g")
    for _ in range(500):
        if ledger_count(ledger, "g-started"):
            break
        await asyncio.sleep(0.01)
    await engine.close()
    assert ledger_count(ledger, "g-finished") == 1

    engine = await open_embedded(test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        assert await client.result("g", timeout=10) == "g"
        history = await client.history("g")
    assert [h.type for h in history].count("StepFailed") == 0, history
    assert ledger_count(ledger, "g-started") == 1 and ledger_count(ledger, "g-tail") == 1


async def test_the_instance_cache_keeps_the_most_recently_used(tmp_path: Path) -> None:
    """With room for two, the instance that keeps getting commands stays cached while
    others come and go: its code never restarts."""
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from stepstream.producers.client import Client
    from tests.conftest import test_registry
    from tests.workflows import RUNS

    config = EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1, cache_size=2)
    engine = await open_embedded(test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        hot = await client.start("counted-waits", 4, instance_id="hot")
        for i in range(3):
            await client.start("counted-waits", 1, instance_id=f"cold-{i}")
            await client.send_event(hot, "e", i)  # the hot one is used after each newcomer
        await client.send_event(hot, "e", 3)
        assert await client.result(hot, timeout=10) == [0, 1, 2, 3]
        assert RUNS["hot"] == 1
        # A cold one was evicted meanwhile: it replays when it is used again.
        await client.send_event("cold-0", "e", "x")
        assert await client.result("cold-0", timeout=10) == ["x"]
        assert RUNS["cold-0"] == 2


async def test_a_large_input_is_stored_once_and_read_back_after_eviction_and_restart(
    tmp_path: Path,
) -> None:
    """The input has a key of its own, written with the start: the meta every transition
    rewrites stays small, and an instance reloaded from storage (evicted from the cache,
    or after a restart) runs with its input."""
    from stepstream.consumers import state_keys
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from stepstream.producers.client import Client
    from tests.conftest import test_registry
    from tests.workflows import RUNS

    blob = "é" * 150_000  # 300 KB encoded
    config = EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1, cache_size=1)
    engine = await open_embedded(test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        big = await client.start("big-input", {"n": 3, "blob": blob}, instance_id="big")
        await client.send_event(big, "e", 0)
        await client.start("counted-waits", 1, instance_id="other")  # evicts the big one
        await client.send_event(big, "e", 1)
        store = engine.host._processor("big").backend.store
        meta = store.get(state_keys.meta("big"))
        stored_input = store.get(state_keys.input_key("big"))
        assert meta is not None and len(meta) < 2_000, len(meta or b"")
        assert stored_input is not None and len(stored_input) > 300_000
        assert RUNS["big"] == 2  # replayed once after its eviction, with its input
        await client.send_event("other", "e", "x")
        assert await client.result("other", timeout=10) == ["x"]

    engine = await open_embedded(test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.send_event("big", "e", 2)
        assert await client.result("big", timeout=10) == {"size": 150_000, "events": [0, 1, 2]}
    assert RUNS["big"] == 3


async def test_buffered_events_are_kept_one_key_each_across_a_restart(tmp_path: Path) -> None:
    """Events the code has not asked for yet wait under keys of their own, not in the meta
    every transition rewrites; the status counts them, and after a restart the code takes
    them in the order they came."""
    from stepstream.consumers import state_keys
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from stepstream.producers.client import Client
    from tests.conftest import test_registry

    items = [{"i": i, "pad": "x" * 2_000} for i in range(30)]
    config = EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)
    engine = await open_embedded(test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        drain = await client.start("drain-after-go", len(items), instance_id="drain")
        for item in items:
            await client.send_event(drain, "item", item)
        assert (await client.status(drain)).buffered_events == 30
        store = engine.host._processor("drain").backend.store
        meta = store.get(state_keys.meta("drain"))
        assert meta is not None and len(meta) < 3_000, len(meta or b"")
        assert len(list(store.scan(state_keys.buffered_prefix("drain")))) == 30

    engine = await open_embedded(test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        assert (await client.status("drain")).buffered_events == 30
        await client.send_event("drain", "go", None)
        assert await client.result("drain", timeout=10) == items
        store = engine.host._processor("drain").backend.store
        assert list(store.scan(state_keys.buffered_prefix("drain"))) == []
        assert (await client.status("drain")).buffered_events == 0


async def test_finished_instances_are_forgotten_after_the_retention(tmp_path: Path) -> None:
    """Finished instances leave the state (all their keys) once the retention has passed
    since they finished; running ones stay; the id can then be started afresh."""
    from stepstream import UnknownInstance
    from stepstream.consumers import state_keys
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from stepstream.producers.client import Client
    from tests.conftest import test_registry

    config = EmbeddedConfig(
        data_dir=str(tmp_path / "data"), partitions=1, retention_s=1.0, sweep_interval_s=0.05
    )
    engine = await open_embedded(test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        done = await client.start("arith", 1, instance_id="done")
        assert await client.result(done, timeout=10) == {"total": 2, "doubled": 4}
        waiting = await client.start("waiter", None, instance_id="waiting")
        assert (await client.status(done)).status == "completed"  # within the retention
        for _ in range(400):
            try:
                await client.status(done)
            except UnknownInstance as exc:
                assert "STEPSTREAM_RETENTION_S" in str(exc)
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the finished instance was never forgotten")
        store = engine.host._processor("done").backend.store
        left = [
            key
            for prefix in (
                state_keys.META,
                state_keys.INPUT,
                state_keys.ENTRY,
                state_keys.HISTORY,
                state_keys.COMMAND,
            )
            for key, _ in store.scan(prefix)
            if b"done" in key
        ]
        assert left == [] and list(store.scan(state_keys.FINISHED)) == []
        assert (await client.status(waiting)).status == "running"  # not finished: kept
        await client.send_event(waiting, "approval", "ok")
        assert await client.result(waiting, timeout=10) == "ok"
        # A new instance may take the forgotten id.
        await client.start("arith", 5, instance_id="done")
        assert await client.result("done", timeout=10) == {"total": 6, "doubled": 12}
        # The log keeps what is still needed: consumed commands and history older than
        # the retention go at a sweep, the last record of each log stays.
        log = engine.db.log
        ends = {kind: log.end_offset(kind, 0) for kind in (COMMANDS, HISTORY)}
        # A processor sweeps between batches and at least once a second when idle (its
        # fetch times out), noting the history's end; once such a note is older than the
        # retention, what came before it goes.
        for n in range(50):
            first = {k: log.read(k, 0, 0, 10**6)[0].offset for k in (COMMANDS, HISTORY)}
            if first[COMMANDS] >= ends[COMMANDS] - 1 and first[HISTORY] >= ends[HISTORY] - 1:
                break
            await client.start("arith", n, instance_id=f"later-{n}")
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"logs not trimmed: first offsets {first}, ends were {ends}")
    # Reopened, each log still ends where it ended, and work goes on.
    engine = await open_embedded(test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        assert engine.db.log.end_offset(COMMANDS, 0) > ends[COMMANDS]
        await client.start("arith", 9, instance_id="after-reopen")
        assert await client.result("after-reopen", timeout=10) == {"total": 10, "doubled": 20}


@pytest.mark.slow
async def test_retention_goes_on_forgetting_after_many_forgotten(tmp_path: Path) -> None:
    """More finished instances than one sweep forgets are all forgotten, over several
    sweeps; and instances that finish after them are forgotten too: each sweep reads the
    finished index on from where the last one stopped, past nothing it has not deleted."""
    from stepstream.consumers import state_keys
    from stepstream.consumers.retention import SWEEP_BATCH
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from stepstream.producers.client import Client
    from tests.conftest import test_registry

    config = EmbeddedConfig(
        data_dir=str(tmp_path / "data"), partitions=1, retention_s=0.5, sweep_interval_s=0.05
    )
    engine = await open_embedded(test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:

        async def run(prefix: str, n: int) -> None:
            gate = asyncio.Semaphore(100)

            async def one(i: int) -> None:
                async with gate:
                    await client.start("arith", i, instance_id=f"{prefix}{i}")
                    assert await client.result(f"{prefix}{i}", timeout=30) == {
                        "total": i + 1,
                        "doubled": 2 * (i + 1),
                    }

            await asyncio.gather(*(one(i) for i in range(n)))

        async def forgotten(prefix: str) -> None:
            for _ in range(600):
                if not (await client.list_page(prefix=prefix, limit=1)).instances:
                    return
                await asyncio.sleep(0.05)
            left = (await client.list_page(prefix=prefix, limit=5)).instances
            raise AssertionError(f"not forgotten: {[i.instance_id for i in left]} ...")

        await run("many-", SWEEP_BATCH * 2 + 500)
        await forgotten("many-")
        for later in range(3):
            await run(f"later{later}-", 20)
            await forgotten(f"later{later}-")
        store = engine.host._processor("many-0").backend.store
        assert list(store.scan(state_keys.FINISHED)) == []
        # A forgotten id may begin again, and is forgotten again.
        await run("many-", 1)
        await forgotten("many-")


async def test_two_waits_on_one_command_both_learn_it_settled(tmp_path: Path) -> None:
    """The first wait to give up (a timed-out retry of a Kafka client's check) must not
    take the shared future from the one still waiting."""
    from stepstream.consumers.partition import Committed
    from stepstream.engine.wire.settle import settled_key
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from tests.conftest import test_registry

    engine = await open_embedded(
        test_registry(), EmbeddedConfig(data_dir=str(tmp_path / "d"), partitions=1)
    )
    try:
        host = engine.host
        first, second = host.settled("i-1", "cmd-1"), host.settled("i-1", "cmd-1")
        host.forget("i-1", "cmd-1")  # the first waiter gave up
        host._committed(Committed([], {settled_key("i-1", "cmd-1"): "dead-lettered: why"}))
        assert second.done() and second.result() == "dead-lettered: why"
        host.forget("i-1", "cmd-1")
        assert host._settled == {} and host._settled_waiters == {}
        assert first is second
    finally:
        await engine.close()
