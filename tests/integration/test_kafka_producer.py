"""The worker's Kafka producer lets go of its brokers when closed.

A closed producer whose handle something still refers to (the frame of a send cancelled
while it waited for acknowledgements) must not keep reconnecting to its brokers for as
long as the process lives."""

from __future__ import annotations

import asyncio

import pytest

from stepstream.consumers.kafka import create_topics
from stepstream.consumers.kafka.producer import LogProducer, OutRecord, ProduceFailed
from stepstream.engine.wire.topics import HISTORY, TopicNames
from tests.conftest import kafka_settings
from tests.kafka_broker import Broker


async def test_a_closed_producer_is_closed_even_while_its_handle_is_still_referenced(
    kafka_broker: Broker,
) -> None:
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, 1)
    topic = TopicNames(settings.prefix).name(HISTORY)
    producer = LogProducer(settings)
    (offset,) = await producer.send([OutRecord(topic, 0, b"k", b"v")])
    assert offset == 0
    handle = producer._producer  # what a cancelled send's frame would still hold
    await asyncio.to_thread(producer.close)
    with pytest.raises(RuntimeError, match="closed"):
        handle.produce(topic, b"late", b"k", partition=0)  # the handle is gone, not idle
    with pytest.raises(ProduceFailed, match="closed"):
        await producer.send([OutRecord(topic, 0, b"k", b"again")])
