"""Snapshots: a worker without local state restores from the newest snapshot of each
partition plus the history after it, and falls back to the whole history when the
newest snapshot is cut short or does not match the history topic.

Workers run in-process (``ThreadedWorker``) against the session's real broker, with a
snapshot every few dozen history records so a short test produces several.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest

from stepstream import UnknownInstance
from stepstream.consumers.kafka import create_topics
from stepstream.consumers.partition import ProcessorConfig
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.wire.records import SnapshotTaken, StateChunk
from stepstream.engine.wire.serde import default_serde
from stepstream.producers.client import Client
from tests.conftest import KAFKA_TEST_PARTITIONS, ThreadedWorker, kafka_settings, kafka_url
from tests.conftest import test_registry as workflows_registry
from tests.integration.test_kafka_backend import (
    decode,
    each_step_succeeded_once,
    instance_on,
    produce_raw,
    read_topic,
    story,
)
from tests.integration.test_workflows import wait_for_status
from tests.kafka_broker import Broker

pytestmark = [pytest.mark.kafka]

SERDE = default_serde()
EVERY = 40


async def worker(settings: KafkaSettings, state_dir: Path) -> ThreadedWorker:
    started = ThreadedWorker(settings, state_dir, workflows_registry(), snapshot_every=EVERY)
    await asyncio.to_thread(started.start)
    return started


async def run_some(client: Client) -> dict[str, Any]:
    """Finished instances on both partitions (history enough for snapshots), plus a
    sleeper, a waiter and a paused instance left unfinished. Returns the finished
    results by instance id."""
    finished = {}
    for partition in range(KAFKA_TEST_PARTITIONS):
        for _ in range(4):
            instance = await client.start("chain", 8, instance_id=instance_on(partition, "ch"))
            finished[instance] = await client.result(instance, timeout=20)
    return finished


async def snapshots_on(settings: KafkaSettings) -> dict[int, list[SnapshotTaken]]:
    found: dict[int, list[SnapshotTaken]] = {}
    for rec in await asyncio.to_thread(read_topic, settings, "snapshots"):
        name, body = decode(rec.value)  # fastavro and the .avsc files alone
        assert name in ("StateChunk", "SnapshotTaken"), name
        record = SERDE.decode(rec.value)
        if isinstance(record, SnapshotTaken):
            assert body["partition"] == rec.partition == record.partition
            found.setdefault(rec.partition, []).append(record)
    return found


async def first_worker(
    broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> tuple[KafkaSettings, ThreadedWorker]:
    """Fresh topics and a worker on them; restores are logged where the test sees them."""
    caplog.set_level(logging.INFO, logger="stepstream.kafka.restore")
    settings = kafka_settings(broker)
    await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
    return settings, await worker(settings, tmp_path / "first")


async def a_snapshot_of_partition_0(settings: KafkaSettings) -> None:
    for _ in range(200):
        if 0 in await snapshots_on(settings):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("partition 0 never had a snapshot")


async def newest_first(client: Client) -> list[str]:
    """Every instance, newest first (one page holds them all)."""
    page = await client.list_page(limit=500)
    assert page.next is None
    return [i.instance_id for i in page.instances]


def restores(caplog: pytest.LogCaptureFixture) -> dict[int, tuple[str, int]]:
    """Partition -> (snapshot id or "None", history records folded), of the last restore."""
    out = {}
    for record in caplog.records:  # its fields, as a JSON log line shows them
        if record.getMessage().startswith("restored in "):
            fields = record.__dict__
            out[fields["partition"]] = (str(fields["snapshot"]), fields["records"])
    return out


async def test_a_worker_without_state_restores_from_the_newest_snapshot(
    kafka_broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings, first = await first_worker(kafka_broker, tmp_path, caplog)
    second: ThreadedWorker | None = None
    try:
        async with Client.connect(kafka_url(settings)) as client:
            finished = await run_some(client)
            sleeper = await client.start("sleeper", 3, instance_id=f"nap-{uuid.uuid4().hex[:6]}")
            waiter = await client.start("waiter", None, instance_id=f"w-{uuid.uuid4().hex[:6]}")
            paused = await client.start("gated", "p", instance_id=f"p-{uuid.uuid4().hex[:6]}")
            await wait_for_status(client, paused, lambda s: bool(s.waits))
            await client.pause(paused)
            await wait_for_status(client, sleeper, lambda s: bool(s.waits))
            await wait_for_status(client, waiter, lambda s: bool(s.waits))
            for _ in range(200):
                taken = await snapshots_on(settings)
                if len(taken) == KAFKA_TEST_PARTITIONS:
                    break
                await asyncio.sleep(0.05)
            assert len(taken) == KAFKA_TEST_PARTITIONS, taken
            await run_some(client)  # history after the snapshots, folded on restore
            stories = {i: await story(client, i) for i in [*finished, sleeper, waiter, paused]}
            listed = await newest_first(client)
            assert len(set(listed)) == len(listed) and set(stories) <= set(listed), listed
            await asyncio.to_thread(first.stop)

            caplog.clear()
            second = await worker(settings, tmp_path / "second")  # no local state
            folded = restores(caplog)
            assert sorted(folded) == list(range(KAFKA_TEST_PARTITIONS)), caplog.text
            # The index by created time came with the snapshots: the same list.
            assert await newest_first(client) == listed
            newest = {p: r[-1].snapshot_id for p, r in (await snapshots_on(settings)).items()}
            for partition, (snapshot, records) in folded.items():
                history = [
                    r
                    for r in await asyncio.to_thread(read_topic, settings, "history")
                    if r.partition == partition
                ]
                assert snapshot == newest[partition], caplog.text
                assert 0 < records < len(history) / 2, (partition, records, len(history))

            for instance, expected in stories.items():
                now = await story(client, instance)
                assert now[: len(expected)] == expected, instance
            for instance, result in finished.items():
                assert await client.result(instance, timeout=5) == result
            # It carries on: the sleep ends (its timer came back from the state), the
            # wait takes its event, the paused instance resumes.
            assert (await client.result(sleeper, timeout=20))["slept"] >= 3
            await client.send_event(waiter, "approval", "yes")
            assert await client.result(waiter, timeout=20) == "yes"
            await client.resume(paused)
            await client.send_event(paused, "go", "g")
            assert await client.result(paused, timeout=20) == ["p-before", "g", "p-after"]
            await each_step_succeeded_once(client, stories)
    finally:
        await asyncio.to_thread((second or first).stop)


async def test_a_snapshot_cut_short_leads_to_the_complete_one_before_it(
    kafka_broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings, first = await first_worker(kafka_broker, tmp_path, caplog)
    second: ThreadedWorker | None = None
    try:
        async with Client.connect(kafka_url(settings)) as client:
            finished = await run_some(client)
            await a_snapshot_of_partition_0(settings)
            await asyncio.to_thread(first.stop)
            records = [r for r in await asyncio.to_thread(read_topic, settings, "snapshots")]
            [taken_at, *_] = [
                r.offset
                for r in reversed(records)
                if r.partition == 0 and isinstance(SERDE.decode(r.value), SnapshotTaken)
            ]
            newest = SERDE.decode(
                next(r.value for r in records if r.offset == taken_at and r.partition == 0)
            )
            assert isinstance(newest, SnapshotTaken)
            dead = StateChunk(
                instance_id="",
                snapshot_id="dead",
                index=0,
                previous_offset=taken_at,
                keys=[b"x"],
                values=[b"y"],
            )
            await asyncio.to_thread(
                produce_raw, settings, "snapshots", [(0, b"", SERDE.encode(dead))]
            )
            caplog.clear()
            second = await worker(settings, tmp_path / "second")
            assert restores(caplog)[0][0] == newest.snapshot_id, caplog.text
            for instance, result in finished.items():
                assert await client.result(instance, timeout=5) == result
    finally:
        await asyncio.to_thread((second or first).stop)


@pytest.mark.parametrize("damage", ["cut-short", "stale"])
async def test_a_snapshot_that_cannot_be_used_falls_back_to_the_whole_history(
    kafka_broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    settings, first = await first_worker(kafka_broker, tmp_path, caplog)
    second: ThreadedWorker | None = None
    try:
        async with Client.connect(kafka_url(settings)) as client:
            finished = await run_some(client)
            await a_snapshot_of_partition_0(settings)
            await asyncio.to_thread(first.stop)
            [newest, *_] = reversed((await snapshots_on(settings))[0])
            if damage == "cut-short":  # a snapshot whose writer died after one chunk
                bad: StateChunk | SnapshotTaken = StateChunk(
                    instance_id="",
                    snapshot_id="dead",
                    index=0,
                    previous_offset=-1,
                    keys=[b"x"],
                    values=[b"y"],
                )
            else:  # a closing record whose history does not match the topic
                bad = SnapshotTaken(
                    instance_id="",
                    snapshot_id="stale",
                    partition=0,
                    first_offset=-1,
                    chunks=0,
                    entries=0,
                    history_offset=newest.history_offset,
                    history_tail=(newest.history_tail + 1) % (1 << 32),
                    commands_offset=newest.commands_offset,
                    timers_offset=newest.timers_offset,
                )
            await asyncio.to_thread(
                produce_raw, settings, "snapshots", [(0, b"", SERDE.encode(bad))]
            )

            caplog.clear()
            second = await worker(settings, tmp_path / "second")
            snapshot, records = restores(caplog)[0]
            assert snapshot == "None", caplog.text
            history = [
                r
                for r in await asyncio.to_thread(read_topic, settings, "history")
                if r.partition == 0
            ]
            assert records >= len(history) - 2, (records, len(history))  # all but new fences
            if damage == "stale":
                assert "discarding the local state" in caplog.text
            for instance, result in finished.items():
                assert await client.result(instance, timeout=5) == result
            fresh = await client.start("chain", 3, instance_id=instance_on(0, "after"))
            assert await client.result(fresh, timeout=20) == 3
    finally:
        await asyncio.to_thread((second or first).stop)


@pytest.mark.parametrize("snapshot_every", [0, 5], ids=["snapshots-off", "snapshots-on"])
async def test_a_forgotten_instance_stays_forgotten_after_a_restore(
    kafka_broker: Broker, tmp_path: Path, snapshot_every: int
) -> None:
    """Retention forgets a finished instance in the history too (InstanceForgotten): a
    worker restoring without local state drops it, and a new instance that took its id
    is the one restored."""
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
    short = ProcessorConfig(retention_s=0.5, sweep_interval_s=0.05)
    first = ThreadedWorker(
        settings,
        tmp_path / "a",
        workflows_registry(),
        snapshot_every=snapshot_every,
        processor=short,
    )
    await asyncio.to_thread(first.start)
    second: ThreadedWorker | None = None
    try:
        async with Client.connect(kafka_url(settings)) as client:
            await client.start("arith", 1, instance_id="reused")
            assert await client.result("reused", timeout=20) == {"total": 2, "doubled": 4}
            gone = await client.start("arith", 2, instance_id="gone")
            await client.result(gone, timeout=20)
            for _ in range(300):
                try:
                    await client.status("reused")
                    await client.status(gone)
                except UnknownInstance:
                    if all([await forgotten(client, i) for i in ("reused", gone)]):
                        break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("never forgotten")
            await client.start("arith", 5, instance_id="reused")
            assert await client.result("reused", timeout=20) == {"total": 6, "doubled": 12}
            await asyncio.to_thread(first.stop)
            second = ThreadedWorker(
                settings,
                tmp_path / "b",
                workflows_registry(),
                processor=ProcessorConfig(retention_s=0),
            )
            await asyncio.to_thread(second.start)
            assert await client.result("reused", timeout=20) == {"total": 6, "doubled": 12}
            history = await client.history("reused")
            assert [h.seq for h in history] == list(range(1, len(history) + 1))
            assert [h.type for h in history].count("WorkflowStarted") == 1
            with pytest.raises(UnknownInstance):
                await client.status(gone)
    finally:
        await asyncio.to_thread((second or first).stop)


async def forgotten(client: Client, instance: str) -> bool:
    try:
        await client.status(instance)
    except UnknownInstance:
        return True
    return False
