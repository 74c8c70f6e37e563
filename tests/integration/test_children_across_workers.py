"""Child workflows and messages between instances owned by different workers: two Kafka
workers split the partitions, and a parent on one worker runs children and sends
messages to instances that live on the other."""

from __future__ import annotations

import asyncio
from pathlib import Path

from stepstream.consumers.kafka import create_topics
from stepstream.engine.wire.topics import partition_for
from stepstream.producers.client import Client
from tests.conftest import (
    ThreadedWorker,
    kafka_settings,
    kafka_url,
)
from tests.conftest import (
    test_registry as workflows_of_tests,
)
from tests.kafka_broker import Broker

PARTITIONS = 2


def _on(partition: int, prefix: str) -> str:
    n = 0
    while partition_for(f"{prefix}-{n}", PARTITIONS) != partition:
        n += 1
    return f"{prefix}-{n}"


async def test_children_and_messages_cross_workers(kafka_broker: Broker, tmp_path: Path) -> None:
    settings = kafka_settings(kafka_broker)
    create_topics(settings, PARTITIONS)
    first = ThreadedWorker(settings, tmp_path / "w1", workflows_of_tests())
    second = ThreadedWorker(settings, tmp_path / "w2", workflows_of_tests())
    try:
        first.start(None)
        second.start(None)
        for worker in (first, second):  # one partition each
            worker.call_sync(worker.worker.wait_assigned(1, timeout=60))
        owners = {p for w in (first, second) for p in w.worker.owned}
        assert owners == {0, 1}
        async with Client.connect(kafka_url(settings)) as client:
            parent = next(
                p
                for n in range(1000)
                if partition_for(p := f"cross-parent-{n}", PARTITIONS) == 0
                and partition_for(f"{p}/kid", PARTITIONS) == 1
                and partition_for(f"{p}/kid#2", PARTITIONS) == 1
            )
            child = _on(1, "cross-box")
            listener = _on(0, "cross-listener")  # on the other worker than the box
            await client.start("waiter", None, instance_id=listener)
            # The parent lives on partition 0, its children on partition 1.
            await client.start("parent", {"n": 2}, instance_id=parent)
            result = await client.result(parent, timeout=60)
            assert result[:2] == [
                {"kid": f"{parent}/kid", "doubled": 4},
                {"kid": f"{parent}/kid#2", "doubled": 6},
            ]
            box = child
            await client.start("mailbox", {"count": 1, "notify": listener}, instance_id=box)
            await client.send_event(box, "line", "x")
            assert await client.result(box, timeout=60) == [["line", "x"]]
            for _ in range(500):
                if (await client.status(listener)).buffered_events:
                    break
                await asyncio.sleep(0.02)
            assert (await client.status(listener)).buffered_events == 1
    finally:
        second.stop()
        first.stop()
