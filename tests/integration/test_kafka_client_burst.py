"""A ``kafka://`` client's burst of starts: its commands reach the broker while the burst is
still being made, not all at once after it.

The broker stamps a start's time (``LogAppendTime``), and the instance's clock and its
first sleeps count from there: commands held back until the caller's whole burst was made
all got the stamp of one request per partition, and their sleeps fell due in the same
millisecond (docs/performance.md, "W2 as a client sees it").
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Consumer, KafkaError, TopicPartition

from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.wire.topics import TopicNames
from stepstream.producers.client import Client
from tests.conftest import KAFKA_TEST_PARTITIONS, ThreadedWorker, kafka_url

BURST = 800


def command_stamps(settings: KafkaSettings) -> dict[int, list[int]]:
    """The broker's timestamp (ms) of every record on the commands topic, by partition."""
    topic = TopicNames(settings.prefix).commands
    consumer = Consumer(
        {
            "bootstrap.servers": settings.bootstrap,
            "group.id": "burst-reader",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    stamps: dict[int, list[int]] = defaultdict(list)
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(KAFKA_TEST_PARTITIONS)])
        open_partitions = set(range(KAFKA_TEST_PARTITIONS))
        while open_partitions:
            msg = consumer.poll(10)
            assert msg is not None, f"reading {topic} stalled"
            err = msg.error()
            if err is not None:
                assert err.code() == KafkaError._PARTITION_EOF, err.str()
                open_partitions.discard(msg.partition() or 0)
                continue
            kind, stamp = msg.timestamp()
            assert kind == TIMESTAMP_LOG_APPEND_TIME, "the broker stamps commands"
            stamps[msg.partition() or 0].append(stamp)
    finally:
        consumer.close()
    return stamps


async def test_a_burst_of_starts_leaves_the_client_while_it_is_made(
    kafka_worker: ThreadedWorker,
) -> None:
    settings = kafka_worker.settings
    async with Client.connect(kafka_url(settings)) as client:
        ids = [f"burst-{i:04d}" for i in range(BURST)]
        started = await asyncio.gather(
            *(client.start("arith", i, instance_id=n) for i, n in enumerate(ids))
        )
        assert started == ids
        last = await client.result(ids[-1], timeout=60)
        assert last == {"total": BURST, "doubled": 2 * BURST}

    stamps = await asyncio.to_thread(command_stamps, settings)
    assert sum(len(s) for s in stamps.values()) == BURST
    for partition, times in stamps.items():
        # Several produce requests per partition, each stamped as it came: the first
        # commands were on the broker before the last ones were made.
        assert len(set(times)) > 1, f"partition {partition}: {len(times)} starts, one stamp"
        assert times == sorted(times), f"partition {partition}: stamps out of order"
