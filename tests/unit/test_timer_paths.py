"""Which way a due timer's fire goes: straight to the partition's processor while it has
applied every command up to the log's end as last heard, else round the commands topic,
behind the commands already there. Either way the timer leaves the index only together
with what its fire did."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from consumers import state_keys as keys
from consumers.embedded import EmbeddedDB, EmbeddedPartition
from consumers.timers import TimerService
from engine.records import TimerFired, TimerScheduled
from engine.seams import Append, CommitBatch
from engine.serde import RecordSerde
from engine.topics import COMMANDS, TIMERS
from engine.virtual_clock import VirtualClock

START_MS = 1_000_000
SERDE = RecordSerde()


class Processor:
    """Stands in for the partition's processor: says whether it is caught up, and keeps
    what it is handed."""

    def __init__(self) -> None:
        self.behind = False
        self.handed: list[TimerFired] = []

    def caught_up(self) -> bool:
        return not self.behind

    def fire(self, fires: list[TimerFired]) -> None:
        self.handed.extend(fires)


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[EmbeddedDB]:
    opened = await EmbeddedDB.open(tmp_path / "data", 1)
    yield opened
    await opened.close()


async def running(db: EmbeddedDB, processor: Processor, clock: VirtualClock) -> TimerService:
    service = TimerService(EmbeddedPartition(db, 0), serde=SERDE, clock=clock, direct=processor)
    await service.start()
    return service


async def schedule(db: EmbeddedDB, instance_id: str) -> TimerScheduled:
    record = TimerScheduled(
        instance_id=instance_id,
        timer_id=f"{instance_id}/sleep/1/nap",
        fire_at_ms=START_MS + 1_000,
        purpose="sleep",
    )
    append = Append(TIMERS, instance_id.encode(), SERDE.encode(record), 0)
    await EmbeddedPartition(db, 0).commit(CommitBatch(appends=[append]))
    return record


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def fires_on_log(db: EmbeddedDB) -> list[TimerFired]:
    records = [SERDE.decode(e.value) for e in db.log.read(COMMANDS, 0, 0, 100)]
    assert all(isinstance(r, TimerFired) for r in records)
    return [r for r in records if isinstance(r, TimerFired)]


def indexed(db: EmbeddedDB, timer: TimerScheduled) -> bool:
    key = keys.timer(timer.fire_at_ms, timer.instance_id, timer.timer_id)
    return EmbeddedPartition(db, 0).store.get(key) is not None


async def test_a_caught_up_processor_is_handed_the_fire_and_the_log_never_sees_it(
    db: EmbeddedDB,
) -> None:
    clock, processor = VirtualClock(START_MS), Processor()
    service = await running(db, processor, clock)
    try:
        timer = await schedule(db, "caught-up")
        await until(lambda: service.pending == 1, "the timer indexed")
        clock.advance(0.999)
        await asyncio.sleep(0.05)
        assert processor.handed == []  # never early
        clock.advance(0.001)
        await until(lambda: bool(processor.handed), "the fire handed over")
        [fire] = processor.handed
        assert (fire.instance_id, fire.timer_id) == (timer.instance_id, timer.timer_id)
        assert (fire.fire_at_ms, fire.command_id) == (timer.fire_at_ms, f"fire:{timer.timer_id}")
        assert fires_on_log(db) == []
        # Out of the index only with the commit of what the fire did (the processor's).
        assert indexed(db, timer) and service.pending == 0
    finally:
        await service.stop()


async def test_a_processor_behind_its_log_gets_the_fire_behind_the_commands_there(
    db: EmbeddedDB,
) -> None:
    clock, processor = VirtualClock(START_MS), Processor()
    processor.behind = True
    service = await running(db, processor, clock)
    try:
        timer = await schedule(db, "behind")
        await until(lambda: service.pending == 1, "the timer indexed")
        clock.advance(1.0)
        await until(lambda: bool(fires_on_log(db)), "the fire appended to the commands")
        [fire] = fires_on_log(db)
        assert (fire.instance_id, fire.timer_id) == (timer.instance_id, timer.timer_id)
        assert processor.handed == []
        assert not indexed(db, timer)  # the append and the index change are one commit
    finally:
        await service.stop()


async def test_a_sleep_fires_straight_to_the_processor_and_leaves_no_index_behind(
    tmp_path: Path,
) -> None:
    from ops.embedded import EmbeddedConfig, open_embedded
    from producers.client import Client
    from tests.conftest import test_registry

    data = tmp_path / "data"
    engine = await open_embedded(test_registry(), EmbeddedConfig(data_dir=str(data), partitions=2))
    async with Client(engine.make_transport(owns_engine=True)) as client:
        naps = [await client.start("sleeper", 0.2, instance_id=f"nap-{n}") for n in range(4)]
        for nap in naps:
            assert (await client.result(nap, timeout=20))["slept"] >= 0.2
            elapsed = [h for h in await client.history(nap) if h.type == "SleepElapsed"]
            assert len(elapsed) == 1 and elapsed[0].command_id.startswith(f"fire:{nap}/")

    db = await EmbeddedDB.open(data, 2)
    try:
        for partition in range(2):
            store = EmbeddedPartition(db, partition).store
            # Fired: out of the index, in the commit that recorded what the fire did.
            assert list(store.scan(keys.TIMER)) == []
            assert list(store.scan(keys.TIMER_BY_ID)) == []
            commands = [SERDE.decode(e.value) for e in db.log.read(COMMANDS, partition, 0, 100)]
            assert not any(isinstance(c, TimerFired) for c in commands)
    finally:
        await db.close()
