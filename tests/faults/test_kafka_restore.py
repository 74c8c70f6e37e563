"""Restore and fencing of a Kafka partition when ownership changes hands untidily.

A handover that leaves the timer index behind the group's timers offset; a competing
fence that lands between a restore's read and its own fence; a deposed owner that keeps
committing after a newer owner's fence; topics deleted and recreated under a worker's
old state; and dead letters acknowledged before the history that says their commands
are done. Workers run in-process (``ThreadedWorker``) against the session's real broker.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from stepstream import StepstreamError, UnknownInstance
from stepstream.consumers import state_keys
from stepstream.consumers.kafka import (
    HistoryReader,
    KafkaPartition,
    LogProducer,
    OutRecord,
    PartitionDB,
    Restored,
    StateDir,
    create_topics,
    restore_partition,
)
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.seams import Append, CommitBatch, SystemClock
from stepstream.engine.wire.records import (
    DeadLetter,
    PartitionFenced,
    Payload,
    StepSucceeded,
    WorkflowStarted,
)
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import (
    COMMANDS,
    DEAD_LETTERS,
    HISTORY,
    MEMBERS,
    TIMERS,
    TopicNames,
    partition_for,
)
from stepstream.producers.client import Client
from tests.conftest import (
    KAFKA_TEST_PARTITIONS,
    ThreadedWorker,
    kafka_settings,
    kafka_url,
)
from tests.conftest import test_registry as workflows_registry
from tests.integration.test_kafka_backend import instance_on, produce_raw, read_topic, story
from tests.integration.test_workflows import wait_for_status
from tests.kafka_broker import Broker

pytestmark = [pytest.mark.kafka]

SERDE = default_serde()


# ---- what a failing test prints ----------------------------------------------------------


async def explain(client: Client, instance: str) -> str:
    """The instance id and its history as its owner serves it (or why it cannot)."""
    try:
        lines = [f"  {seq} {type_} {attrs}" for seq, type_, attrs in await story(client, instance)]
    except Exception as exc:  # a debugging aid: never hide the failure being explained
        lines = [f"  (history unavailable: {type(exc).__name__}: {exc})"]
    return "\n".join([f"instance {instance}, history:", *lines])


def history_topic(settings: KafkaSettings, partition: int) -> list[tuple[int, str, str, int, int]]:
    """(offset, type, instance, seq, epoch) of every record on one history partition."""
    rows = []
    for rec in read_topic(settings, HISTORY):
        if rec.partition == partition:
            r = SERDE.decode(rec.value)
            rows.append((rec.offset, r.type, r.instance_id, r.seq, r.epoch))
    return rows


def dump(rows: Sequence[tuple[int, str, str, int, int]]) -> str:
    return "\n".join(
        f"  @{offset} {type_} instance={instance!r} seq={seq} epoch={epoch}"
        for offset, type_, instance, seq, epoch in rows
    )


async def result_or_explain(client: Client, instance: str, timeout: float) -> object:
    try:
        return await client.result(instance, timeout=timeout)
    except StepstreamError as exc:
        pytest.fail(f"{type(exc).__name__}: {exc}\n{await explain(client, instance)}")


# ---- worker and topic plumbing -------------------------------------------------------------


def open_partition_db(state_dir: Path, settings: KafkaSettings, partition: int) -> PartitionDB:
    """A stopped worker's state of ``partition``, at the path its runner uses."""
    claimed = StateDir.claim(state_dir, settings.prefix)
    try:
        path = claimed.partition_path(partition)
    finally:
        claimed.release()
    return PartitionDB.open(path, partition, KAFKA_TEST_PARTITIONS)


def group_committed(settings: KafkaSettings, kind: str, partition: int) -> int | None:
    """The workers group's committed offset of ``kind`` on ``partition``."""
    consumer = Consumer(
        {
            "bootstrap.servers": settings.bootstrap,
            "group.id": f"{settings.prefix}.workers",
            "enable.auto.commit": False,
        }
    )
    try:
        topic = TopicNames(settings.prefix).name(kind)
        [tp] = consumer.committed([TopicPartition(topic, partition)], timeout=10)
        return tp.offset if tp.offset >= 0 else None
    finally:
        consumer.close()


async def started_worker(settings: KafkaSettings, state_dir: Path) -> ThreadedWorker:
    worker = ThreadedWorker(settings, state_dir, workflows_registry())
    try:
        await asyncio.to_thread(worker.start)
    except BaseException:
        await asyncio.to_thread(worker.stop)
        raise
    return worker


async def restore_alone(
    db: PartitionDB,
    partition: int,
    settings: KafkaSettings,
    reader: HistoryReader,
    producer: LogProducer,
) -> tuple[PartitionDB, Restored]:
    """``restore_partition`` as an owner runs it, outside a worker (no group offsets)."""
    return await restore_partition(
        db,
        partition,
        reader=reader,
        producer=producer,
        serde=SERDE,
        clock=SystemClock(),
        topics=TopicNames(settings.prefix),
        group_offsets={COMMANDS: None, TIMERS: None},
    )


async def new_topics(broker: Broker) -> KafkaSettings:
    settings = kafka_settings(broker)
    await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
    return settings


def fence_record(epoch: int, partition: int) -> bytes:
    return SERDE.encode(
        PartitionFenced(
            instance_id="",
            time_ms=int(time.time() * 1000),
            command_id=f"fence:{epoch}",
            epoch=epoch,
            partition=partition,
        )
    )


# ---- 1. timers after a handover -----------------------------------------------------------


async def test_timers_indexed_by_another_owner_are_rebuilt_from_instance_state(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    """The group's timers offset is past a TimerScheduled this state never indexed (as
    when another owner indexed it): the sleep must still end on the restored worker."""
    settings = await new_topics(kafka_broker)
    state_dir = tmp_path / "a"
    first: ThreadedWorker | None = await started_worker(settings, state_dir)
    second: ThreadedWorker | None = None
    try:
        async with Client.connect(kafka_url(settings)) as client:
            instance = await client.start("sleeper", 4, instance_id=f"sleeper-{uuid.uuid4().hex}")
            partition = partition_for(instance, KAFKA_TEST_PARTITIONS)
            await wait_for_status(
                client, instance, lambda s: [w.kind for w in s.waits] == ["sleep"]
            )
            # The timer is indexed and its offset committed to the group before the stop.
            deadline = time.monotonic() + 10
            while not await asyncio.to_thread(group_committed, settings, TIMERS, partition):
                assert time.monotonic() < deadline, "the timers offset was never committed"
                await asyncio.sleep(0.1)
            assert first is not None
            await asyncio.to_thread(first.stop)
            first = None

            # What the state of an owner that never saw the TimerScheduled record looks like.
            db = open_partition_db(state_dir, settings, partition)
            try:
                index = [
                    k for p in (state_keys.TIMER, state_keys.TIMER_BY_ID) for k, _ in db.scan(p)
                ]
                assert len(index) == 2, f"expected one indexed timer, found {index}"
                db.write(deletes=index, offsets={TIMERS: 0})
            finally:
                db.close()

            second = await started_worker(settings, state_dir)
            result = await result_or_explain(client, instance, timeout=15)
            assert isinstance(result, dict) and result["slept"] >= 4, await explain(
                client, instance
            )
    finally:
        for worker in (first, second):
            if worker is not None:
                await asyncio.to_thread(worker.stop)


async def test_instances_an_older_owner_of_the_state_left_unindexed_are_listed(
    kafka_broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rollback on a worker that keeps its state directory: an older version, which
    keeps neither the index by created time nor the one by finish time, owned the
    partition from the same state in between. When this version owns it again,
    newest-first lists show every instance and retention's index has every finished one;
    a restart with nobody in between reads no meta to find that out."""
    settings = await new_topics(kafka_broker)
    state_dir = tmp_path / "a"
    worker: ThreadedWorker | None = await started_worker(settings, state_dir)
    try:
        async with Client.connect(kafka_url(settings)) as client:
            ids = [instance_on(0, f"older-{n}") for n in range(4)]
            for instance in ids:
                await client.start("arith", 1, instance_id=instance)
                await result_or_explain(client, instance, timeout=15)
            listed = [i.instance_id for i in (await client.list_page(prefix="older-")).instances]
            assert sorted(listed) == sorted(ids)
            assert worker is not None
            await asyncio.to_thread(worker.stop)
            worker = None

            # The older owner's state: its own epoch on it, two of the instances without
            # their keys in either index (it ran them), the marks as this version left them.
            db = open_partition_db(state_dir, settings, 0)
            try:
                started = [k for k, _ in db.scan(state_keys.STARTED) if b"older-" in k]
                finished = [k for k, _ in db.scan(state_keys.FINISHED) if b"older-" in k]
                assert len(started) == 4 and len(finished) == 4
                assert db.get(state_keys.STARTED_INDEXED) is not None
                db.write(deletes=started[:2] + finished[:2], epoch=db.epoch + 1)
            finally:
                db.close()

            caplog.set_level(logging.INFO, logger="stepstream.partition")
            worker = await started_worker(settings, state_dir)
            again = [i.instance_id for i in (await client.list_page(prefix="older-")).instances]
            assert sorted(again) == sorted(ids)
            assert again == listed  # newest first, as before the rollback
            assert any(r.getMessage().startswith("indexed ") for r in caplog.records)
            await asyncio.to_thread(worker.stop)
            worker = None
            db = open_partition_db(state_dir, settings, 0)
            try:
                assert [k for k, _ in db.scan(state_keys.FINISHED) if b"older-" in k] == finished
            finally:
                db.close()

            caplog.clear()
            worker = await started_worker(settings, state_dir)
            last = [i.instance_id for i in (await client.list_page(prefix="older-")).instances]
            assert last == listed
            indexed = [
                r.getMessage() for r in caplog.records if r.getMessage().startswith("indexed ")
            ]
            assert not indexed
            await asyncio.to_thread(worker.stop)
            worker = None

        # A restore alone (an owner revoked before it resumes) moves the marks on: its
        # successor trusts them, instead of reading every meta.
        db = open_partition_db(state_dir, settings, 0)
        reader = await asyncio.to_thread(HistoryReader, settings)
        producer = await asyncio.to_thread(LogProducer, settings)
        try:
            db, restored = await restore_alone(db, 0, settings, reader, producer)
            mark = str(restored.epoch).encode()
            assert restored.previous_epoch < restored.epoch
            assert db.get(state_keys.STARTED_INDEXED) == db.get(state_keys.FINISHED_INDEXED) == mark
        finally:
            db.close()
            await asyncio.to_thread(reader.close)
            await asyncio.to_thread(producer.close)
    finally:
        if worker is not None:
            await asyncio.to_thread(worker.stop)


# ---- 2. a competing fence during restore -------------------------------------------------


class CompetingProducer(LogProducer):
    """Right before our first fence goes out, another owner's fence of a higher epoch
    lands on the same history partition."""

    def __init__(self, settings: KafkaSettings, competitor_epoch: int) -> None:
        super().__init__(settings, client_id="test-competing-fence")
        self.competitor_epoch = competitor_epoch
        self.fences_sent = 0
        self._history = TopicNames(settings.prefix).history

    async def send(self, records: Sequence[OutRecord]) -> list[int]:
        fences = [r for r in records if r.topic == self._history and r.key == b""]
        if fences and self.fences_sent == 0:
            theirs = fence_record(self.competitor_epoch, fences[0].partition)
            await super().send([OutRecord(self._history, fences[0].partition, b"", theirs)])
        self.fences_sent += len(fences)
        return await super().send(records)


async def test_restore_fences_again_above_a_competing_fence(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = await new_topics(kafka_broker)
    partition = 0
    competitor = int(time.time() * 1000) + 10**7
    db = PartitionDB.open(str(tmp_path / "p0"), partition, KAFKA_TEST_PARTITIONS)
    reader = await asyncio.to_thread(HistoryReader, settings)
    producer = await asyncio.to_thread(CompetingProducer, settings, competitor)
    try:
        db, restored = await asyncio.wait_for(
            restore_alone(db, partition, settings, reader, producer), 30
        )
        rows = await asyncio.to_thread(history_topic, settings, partition)
        fences = [
            (offset, epoch) for offset, type_, _, _, epoch in rows if type_ == "PartitionFenced"
        ]
        shown = f"history partition {partition}:\n{dump(rows)}"
        assert restored.epoch > competitor, shown
        assert producer.fences_sent == 2, shown
        assert len(fences) == 3 and fences[0][1] == competitor, shown
        assert fences[1][1] < competitor < fences[2][1] == restored.epoch, shown
        assert db.epoch == restored.epoch, shown
        assert db.offset(HISTORY) == fences[2][0] + 1, shown
    finally:
        db.close()
        await asyncio.to_thread(reader.close)
        await asyncio.to_thread(producer.close)


# ---- 3. a deposed owner that keeps running ------------------------------------------------


async def test_a_deposed_owner_stops_at_the_gap_and_its_successor_ignores_it(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = await new_topics(kafka_broker)
    state_dir = tmp_path / "a"
    partition = 0
    first: ThreadedWorker | None = await started_worker(settings, state_dir)
    second: ThreadedWorker | None = None
    try:
        async with Client.connect(kafka_url(settings), command_timeout=2) as client:
            instance = instance_on(partition, "deposed")
            await client.start("gated", instance, instance_id=instance)
            await wait_for_status(client, instance, lambda s: [w.event for w in s.waits] == ["go"])

            # A new owner's fence, as its restore appends it; the first worker never hears
            # of a rebalance.
            foreign = int(time.time() * 1000) + 10**7
            await asyncio.to_thread(
                produce_raw, settings, HISTORY, [(partition, b"", fence_record(foreign, partition))]
            )
            # Durable once the broker has it; the deposed owner never confirms it, and the
            # client stops waiting for that after command_timeout.
            await client.send_event(instance, "go", "late")
            waits = [w.event for w in (await client.status(instance)).waits]
            assert waits == ["go"], (
                "the deposed worker applied a command after a newer owner's fence\n"
                + await explain(client, instance)
            )
            assert first is not None
            assert first.worker.failed is None, first.worker.failed

            rows = await asyncio.to_thread(history_topic, settings, partition)
            shown = (
                f"{await explain(client, instance)}\nhistory partition {partition}:\n{dump(rows)}"
            )
            [fence_at] = [o for o, t, _, _, e in rows if t == "PartitionFenced" and e == foreign]
            after = [row for row in rows if row[0] > fence_at]
            # The deposed worker did produce its commit; every reader skips it (lower epoch).
            assert after and all(r[2] == instance and r[4] < foreign for r in after), shown

            await asyncio.to_thread(first.stop)
            first = None
            db = open_partition_db(state_dir, settings, partition)
            try:
                covered = db.offset(HISTORY)
            finally:
                db.close()
            assert covered is not None and covered <= fence_at, (
                f"the deposed worker wrote state covering history up to {covered}, past the "
                f"foreign fence at {fence_at}\n{shown}"
            )

            second = await started_worker(settings, state_dir)
            result = await result_or_explain(client, instance, timeout=20)
            entries = await client.history(instance)
            shown = f"{await explain(client, instance)}\nhistory partition {partition}:\n" + dump(
                await asyncio.to_thread(history_topic, settings, partition)
            )
            assert result == [f"{instance}-before", "late", f"{instance}-after"], shown
            successes = Counter(e.attributes["key"] for e in entries if e.type == "StepSucceeded")
            assert successes == {"before": 1, "after": 1}, shown
            assert [e.seq for e in entries] == list(range(1, len(entries) + 1)), shown
    finally:
        for worker in (first, second):
            if worker is not None:
                await asyncio.to_thread(worker.stop)


async def test_records_of_a_stale_lower_epoch_writer_do_not_stop_the_owner(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    """A gap in the owner's history offsets that holds only records of a lower epoch (a
    stale writer that has not noticed it was fenced) is ignored by every reader, and
    the owner carries on."""
    settings = await new_topics(kafka_broker)
    partition = 0
    worker = await started_worker(settings, tmp_path / "a")
    try:
        async with Client.connect(kafka_url(settings), command_timeout=10) as client:
            instance = instance_on(partition, "stale")
            await client.start("gated", instance, instance_id=instance)
            await wait_for_status(client, instance, lambda s: [w.event for w in s.waits] == ["go"])
            stale = WorkflowStarted(
                instance_id=instance,
                seq=99,
                command_id="stale",
                epoch=1,
                workflow="gated",
                version="1",
                input=_payload(),
            )
            await asyncio.to_thread(
                produce_raw,
                settings,
                HISTORY,
                [(partition, instance.encode(), SERDE.encode(stale))],
            )
            await client.send_event(instance, "go", "on")
            result = await result_or_explain(client, instance, timeout=20)
            assert result == [f"{instance}-before", "on", f"{instance}-after"]
            assert worker.worker.failed is None, worker.worker.failed
            entries = await client.history(instance)
            assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
    finally:
        await asyncio.to_thread(worker.stop)


# ---- 4. history shorter than the local state ---------------------------------------------


def recreate_topics(settings: KafkaSettings) -> None:
    """Delete every topic of the prefix and create them again, empty."""
    names = TopicNames(settings.prefix)
    topics = [names.name(kind) for kind in (COMMANDS, HISTORY, TIMERS, DEAD_LETTERS, MEMBERS)]
    admin = AdminClient({"bootstrap.servers": settings.bootstrap})
    for future in admin.delete_topics(topics, operation_timeout=10).values():
        future.result(10)
    deadline = time.monotonic() + 20
    while True:
        try:
            create_topics(settings, KAFKA_TEST_PARTITIONS)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        break
    # What a fresh broker holds: no history at all.
    assert read_topic(settings, HISTORY) == []


async def test_recreated_topics_discard_the_old_state_quickly(
    kafka_broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = await new_topics(kafka_broker)
    state_dir = tmp_path / "a"
    worker: ThreadedWorker | None = await started_worker(settings, state_dir)
    try:
        async with Client.connect(kafka_url(settings)) as client:
            # Enough history on both partitions that the state is ahead of the new topics.
            old = [
                await client.start("chain", 3, instance_id=instance_on(p, "old"))
                for p in range(KAFKA_TEST_PARTITIONS)
            ]
            for instance in old:
                assert await result_or_explain(client, instance, timeout=20) == 3
            # The local state still holds these; printed if the restart goes wrong.
            before = "\n".join([await explain(client, instance) for instance in old])
        assert worker is not None
        await asyncio.to_thread(worker.stop)
        worker = None

        await asyncio.to_thread(recreate_topics, settings)

        caplog.set_level(logging.WARNING, logger="stepstream.kafka.restore")
        worker = ThreadedWorker(settings, state_dir, workflows_registry())
        try:
            await asyncio.wait_for(asyncio.to_thread(worker.start), 30)
        except TimeoutError:
            pytest.fail(
                "a worker on the old state dir did not own its partitions within 30 s of the "
                f"topics being recreated; the state it kept:\n{before}"
            )
        discarded = [
            r.getMessage()
            for r in caplog.records
            if r.name == "stepstream.kafka.restore"
            and "discarding the local state" in r.getMessage()
        ]
        assert len(discarded) == KAFKA_TEST_PARTITIONS, f"{discarded}\n{before}"

        async with Client.connect(kafka_url(settings)) as client:
            fresh = await client.start("chain", 2, instance_id=f"fresh-{uuid.uuid4().hex}")
            assert await result_or_explain(client, fresh, timeout=20) == 2
            for instance in old:
                with pytest.raises(UnknownInstance):
                    await client.status(instance)
                    survived = await explain(client, instance)
                    pytest.fail(f"an instance of the deleted topics survived\n{survived}")
    finally:
        if worker is not None:
            await asyncio.to_thread(worker.stop)


# ---- 5. dead letters before history ------------------------------------------------------


class RecordingProducer:
    """Stands in for ``LogProducer``: notes each send and its acknowledgement."""

    def __init__(self, history_topic: str, history_from: int) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self._next: dict[str, int] = {history_topic: history_from}

    async def send(self, records: Sequence[OutRecord]) -> list[int]:
        topics = [r.topic for r in records]
        self.calls.append(("send", topics))
        await asyncio.sleep(0.01)
        offsets = []
        for topic in topics:
            offsets.append(self._next.get(topic, 0))
            self._next[topic] = offsets[-1] + 1
        self.calls.append(("acked", topics))
        return offsets


async def test_dead_letters_are_acknowledged_before_the_history_of_the_batch(
    tmp_path: Path,
) -> None:
    topics = TopicNames("dl")
    partition = 0
    instance = instance_on(partition, "dl")
    db = PartitionDB.open(str(tmp_path / "p0"), partition, KAFKA_TEST_PARTITIONS)
    db.write(offsets={HISTORY: 7, COMMANDS: 2})
    producer = RecordingProducer(topics.history, 7)
    consumed: list[tuple[str, int, int]] = []
    failures: list[BaseException] = []
    backend = KafkaPartition(
        db=db,
        partition=partition,
        partitions=KAFKA_TEST_PARTITIONS,
        epoch=5,
        sources={},
        producer=cast(LogProducer, producer),
        topics=topics,
        consumed=lambda kind, p, offset: consumed.append((kind, p, offset)),
        on_failure=failures.append,
    )
    started = WorkflowStarted(
        instance_id=instance, seq=1, epoch=5, workflow="arith", version="1", input=_payload()
    )
    succeeded = StepSucceeded(
        instance_id=instance, seq=2, epoch=5, key="add", attempt=1, result=_payload()
    )
    letter = DeadLetter(
        instance_id=instance,
        source_topic=topics.commands,
        partition=partition,
        offset=2,
        key=instance.encode(),
        value=b"junk",
        reason="undecodable record",
    )
    batch = CommitBatch(
        appends=[
            Append(HISTORY, instance.encode(), SERDE.encode(started)),
            Append(DEAD_LETTERS, instance.encode(), SERDE.encode(letter), partition),
            Append(HISTORY, instance.encode(), SERDE.encode(succeeded)),
        ],
        offsets={COMMANDS: 3},
    )
    try:
        await backend.commit(batch)
        assert producer.calls == [
            ("send", [topics.dead_letters]),
            ("acked", [topics.dead_letters]),
            ("send", [topics.history, topics.history]),
            ("acked", [topics.history, topics.history]),
        ], producer.calls
        assert failures == []
        # The offsets of the split sends map back to their records.
        assert db.offset(HISTORY) == 9
        assert db.offset(COMMANDS) == 3
        assert consumed == [(COMMANDS, partition, 3)]
    finally:
        db.close()


def _payload() -> Payload:
    return Payload("application/json", b"1")
