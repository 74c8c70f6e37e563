"""A source record read again after kill -9 applies once.

A `stepstream worker` subprocess (``tests.source_workflows``: orders start ``src-order``,
payments send it ``paid``) turns the records of two source topics into commands, and the
instances finish; it commits its source offsets only every hour, so when it is killed
with SIGKILL none are committed. Its successor reads both topics again from the start and
publishes every command a second time, under the same ``topic/partition/offset`` ids; the
processors must apply none of them again: one start and one event per instance, nothing
ignored, nothing buffered.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest

from stepstream.consumers.kafka import create_topics
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import COMMANDS
from stepstream.producers.client import Client
from tests.conftest import KAFKA_TEST_PARTITIONS, kafka_settings, kafka_url
from tests.faults.test_kafka_failover import WorkerProcess, until
from tests.integration.test_kafka_backend import instance_on, read_topic
from tests.integration.test_sources import json_value, make_topics, produce, result, started
from tests.kafka_broker import Broker

pytestmark = [pytest.mark.slow, pytest.mark.kafka]
SERDE = default_serde()


async def test_a_record_read_again_after_kill_9_applies_once(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = kafka_settings(kafka_broker)
    create_topics(settings, KAFKA_TEST_PARTITIONS)
    run = uuid.uuid4().hex[:8]
    orders, payments = f"src-kill-orders-{run}", f"src-kill-paid-{run}"
    make_topics(kafka_broker, orders, payments)
    env = {
        "STEPSTREAM_TEST_SOURCE_TOPIC": orders,
        "STEPSTREAM_TEST_EVENT_TOPIC": payments,
        "STEPSTREAM_SOURCES_COMMIT_INTERVAL_S": "3600",
    }

    def worker(name: str) -> WorkerProcess:
        return WorkerProcess(
            settings,
            tmp_path / name,
            tmp_path,
            tmp_path / f"{name}.log",
            workflows="tests.source_workflows",
            env=env,
        )

    instances = [f"k-{i}-{run}" for i in range(6)]
    first = worker("a")
    first.start()
    try:
        produce(
            kafka_broker,
            orders,
            [(i.encode(), json_value({"wait": True}), None) for i in instances],
        )
        async with Client.connect(kafka_url(settings)) as client:
            for instance in instances:
                await started(client, instance)
            produce(
                kafka_broker,
                payments,
                [(i.encode(), json_value({"amount": n}), None) for n, i in enumerate(instances)],
                partition=1,
            )
            for n, instance in enumerate(instances):
                assert (await result(client, instance))["paid"] == {"amount": n}
    finally:
        first.kill()  # before any source offset is committed

    second = worker("b")
    second.start()
    try:
        commands = lambda: read_topic(settings, COMMANDS)  # noqa: E731
        wanted = 2 * 2 * len(instances)  # each start and each event, published twice

        async def published_again() -> bool:
            seen = Counter(
                command_id
                for command_id in (SERDE.decode(r.value).command_id for r in commands())
                if "/" in command_id
            )
            return sum(seen.values()) >= wanted

        await until(published_again, "the successor publishing every source command again")
        async with Client.connect(kafka_url(settings)) as client:
            # A fresh order on each commands partition: once it finished, the partition
            # has processed every command published before it.
            barriers = [instance_on(p, f"barrier-{run}") for p in range(KAFKA_TEST_PARTITIONS)]
            produce(kafka_broker, orders, [(b.encode(), json_value({}), None) for b in barriers])
            for barrier in barriers:
                assert await result(client, barrier) == {"input": {}}
            for instance in instances:
                types = Counter(h.type for h in await client.history(instance))
                assert types["WorkflowStarted"] == 1, (instance, types)
                assert types["WaitSatisfied"] == 1, (instance, types)
                assert types["CommandIgnored"] == 0, (instance, types)
                assert types["EventBuffered"] == 0, (instance, types)
        seen = Counter(SERDE.decode(r.value).command_id for r in commands())
        for n in range(len(instances)):
            assert seen[f"{orders}/0/{n}"] == 2 and seen[f"{payments}/1/{n}"] == 2, seen
    finally:
        second.stop()
