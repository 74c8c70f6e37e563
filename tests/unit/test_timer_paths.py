"""Which way a due timer's fire goes: straight to the partition's processor while it has
applied every command up to the log's end as last heard, else round the commands topic,
behind the commands already there. Either way the timer leaves the index only together
with what its fire did."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from stepstream.consumers import state_keys as keys
from stepstream.consumers.embedded import EmbeddedDB, EmbeddedPartition
from stepstream.consumers.timers import WINDOW, TimerService
from stepstream.engine.seams import Append, CommitBatch
from stepstream.engine.virtual_clock import VirtualClock
from stepstream.engine.wire.records import TimerCancelled, TimerFired, TimerScheduled
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.topics import COMMANDS, TIMERS

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


async def running(
    db: EmbeddedDB, processor: Processor, clock: VirtualClock, window: int = WINDOW
) -> TimerService:
    service = TimerService(
        EmbeddedPartition(db, 0), serde=SERDE, clock=clock, direct=processor, window=window
    )
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
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from stepstream.producers.client import Client
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


# ---- the window: only the soonest timers in memory ---------------------------------


async def append_timers(db: EmbeddedDB, records: list[TimerScheduled | TimerCancelled]) -> None:
    appends = [Append(TIMERS, r.instance_id.encode(), SERDE.encode(r), 0) for r in records]
    await EmbeddedPartition(db, 0).commit(CommitBatch(appends=appends))


def nap(n: int, due_ms: int) -> TimerScheduled:
    return TimerScheduled(
        instance_id=f"w-{n}", timer_id=f"w-{n}/sleep/1/nap", fire_at_ms=due_ms, purpose="sleep"
    )


def cancel(n: int) -> TimerCancelled:
    return TimerCancelled(instance_id=f"w-{n}", timer_id=f"w-{n}/sleep/1/nap")


async def fire_all(
    service: TimerService, processor: Processor, clock: VirtualClock, until_ms: int, window: int
) -> None:
    """Move the clock on 50 ms at a time, each time waiting for every fire due by then,
    and check the service never holds more than its window."""
    while clock.now_ms() < until_ms:
        clock.advance(0.05)
        now = clock.now_ms()

        def all_due_fired(now: int = now) -> bool:
            return (service.next_due_ms() or now + 1) > now

        await until(all_due_fired, f"the fires due by {now}")
        assert service.held <= window


async def test_past_its_window_the_service_holds_the_soonest_and_fires_the_rest_from_the_index(
    db: EmbeddedDB,
) -> None:
    clock, processor = VirtualClock(START_MS), Processor()
    service = await running(db, processor, clock, window=8)
    try:
        order = [(n * 7) % 40 for n in range(40)]  # every number once, out of due order
        due = {n: START_MS + 100 + 100 * n for n in order}
        await append_timers(db, [nap(n, due[n]) for n in order[:15]])
        await append_timers(db, [nap(n, due[n]) for n in order[15:]])
        await until(lambda: service.pending == 40, "40 timers indexed")
        assert service.held <= 8
        # Cancels and moves, of timers held and of timers in the index only.
        # Cancels and moves, of timers held and of timers in the index only; one moved
        # and one cancelled in the same batch that scheduled it.
        cancelled = {1, 20, 33, 40}
        await append_timers(
            db,
            [nap(40, START_MS + 3_000), nap(41, START_MS + 3_100)]
            + [cancel(n) for n in cancelled]
            + [nap(2, START_MS + 3_950), nap(30, START_MS + 150), nap(35, START_MS + 3_650)]
            + [nap(41, START_MS + 3_300)],
        )
        due.update({2: START_MS + 3_950, 30: START_MS + 150, 35: START_MS + 3_650})
        due[41] = START_MS + 3_300
        # More due in the same millisecond than one read from the index takes.
        due.update({n: START_MS + 2_020 for n in range(42, 47)})
        await append_timers(db, [nap(n, START_MS + 2_020) for n in range(42, 47)])
        for n in cancelled & set(due):
            del due[n]
        await until(lambda: service.pending == len(due), "the cancels indexed")
        await fire_all(service, processor, clock, START_MS + 4_200, window=8)

        fired = {f.instance_id: f for f in processor.handed}
        assert len(processor.handed) == len(fired) == len(due) == 43  # each once
        for n, due_ms in due.items():
            fire = fired[f"w-{n}"]
            assert fire.fire_at_ms == due_ms  # at its latest schedule
            assert due_ms <= fire.time_ms < due_ms + 100  # never early, within a step
        assert [f.fire_at_ms for f in processor.handed] == sorted(due.values())
        assert service.pending == 0
    finally:
        await service.stop()


async def test_a_restart_holds_only_its_window_of_what_the_index_has(db: EmbeddedDB) -> None:
    clock, processor = VirtualClock(START_MS), Processor()
    first = await running(db, processor, clock)
    due = {n: START_MS + 100 + 50 * n for n in range(30)}
    await append_timers(db, [nap(n, due[n]) for n in range(30)])
    store = EmbeddedPartition(db, 0).store
    await until(lambda: len(list(store.scan(keys.TIMER))) == 30, "30 timers indexed")
    await first.stop()

    service = await running(db, processor, clock, window=6)
    try:
        assert (service.pending, service.held) == (30, 6 // 2)
        await fire_all(service, processor, clock, START_MS + 1_700, window=6)
        assert [f.fire_at_ms for f in processor.handed] == sorted(due.values())
    finally:
        await service.stop()


async def test_timers_scheduled_overdue_past_the_window_never_bring_back_a_fired_one(
    db: EmbeddedDB,
) -> None:
    clock, processor = VirtualClock(START_MS), Processor()
    service = await running(db, processor, clock, window=8)
    try:
        await append_timers(db, [nap(0, START_MS + 100)])
        await until(lambda: service.pending == 1, "the first timer indexed")
        clock.advance(0.2)
        await until(lambda: len(processor.handed) == 1, "the first timer fired")
        # Its index keys stay until the processor commits what the fire did (this stand-in
        # never does); ten timers already overdue, due before it, overflow the window.
        await append_timers(db, [nap(n, START_MS + 80 + n) for n in range(1, 11)])
        await fire_all(service, processor, clock, START_MS + 1_000, window=8)
        assert sorted(f.instance_id for f in processor.handed) == sorted(
            f"w-{n}" for n in range(11)
        )
    finally:
        await service.stop()


async def test_index_keys_of_the_layout_before_are_upgraded_and_fire(db: EmbeddedDB) -> None:
    import struct

    due = {n: START_MS + 100 + 50 * n for n in range(10)}
    old_layout = CommitBatch()
    for n, due_ms in due.items():
        timer_id = f"w-{n}/sleep/1/nap"
        old_layout.put(
            keys.TIMER + struct.pack(">Q", due_ms) + timer_id.encode(), f"w-{n}".encode()
        )
        old_layout.put(keys.TIMER_BY_ID + timer_id.encode(), str(due_ms).encode())
    await EmbeddedPartition(db, 0).commit(old_layout)

    clock, processor = VirtualClock(START_MS), Processor()
    service = await running(db, processor, clock, window=8)
    try:
        store = EmbeddedPartition(db, 0).store
        assert sorted(k for k, _ in store.scan(keys.TIMER)) == sorted(
            keys.timer(due_ms, f"w-{n}", f"w-{n}/sleep/1/nap") for n, due_ms in due.items()
        )
        assert (service.pending, service.held) == (10, 4)
        await fire_all(service, processor, clock, START_MS + 700, window=8)
        assert [(f.instance_id, f.fire_at_ms) for f in processor.handed] == [
            (f"w-{n}", due_ms) for n, due_ms in sorted(due.items())
        ]
    finally:
        await service.stop()
