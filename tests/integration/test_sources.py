"""Kafka topics as event sources, against the test broker.

One worker reads several user topics at once (each a fresh topic with two partitions):
JSON records that start workflows by key, events correlated by a header and by a field
path, Avro in single-object encoding and in Confluent's wire format, raw bytes. Records
that cannot be read land in ``<prefix>.dead-letters`` with their coordinates while the
good records after them (and the other sources, one of them a topic that does not exist)
still run; the lag of every source partition comes down to 0. The example of docs/kafka.md
(examples/orders_source.py) runs on a `stepstream worker` that finds its ``Source``
declarations by itself, and `stepstream dev` reads sources from the cluster that
``STEPSTREAM_SOURCES_BOOTSTRAP`` names.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import uuid
from pathlib import Path
from typing import Any

import fastavro
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from fastavro.schema import fingerprint, to_parsing_canonical_form

from examples import orders_source
from stepstream import Client, ConnectionFailed, Source, UnknownInstance
from stepstream.consumers.embedded import EmbeddedDB
from stepstream.consumers.kafka import create_topics
from stepstream.engine.api.workflow import Registry
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import DEAD_LETTERS
from tests.conftest import ThreadedWorker, kafka_settings, kafka_url
from tests.integration.test_kafka_backend import decode, read_topic
from tests.kafka_broker import Broker

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[2]
SERDE = default_serde()

PAYMENT = {
    "type": "record",
    "name": "Payment",
    "namespace": "shop",
    "fields": [
        {"name": "order_id", "type": "string"},
        {"name": "amount", "type": "double"},
    ],
}
CONFLUENT_SCHEMA_ID = 7


def make_topics(broker: Broker, *names: str) -> None:
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    futures = admin.create_topics([NewTopic(n, 2, 1) for n in names], request_timeout=30)
    for future in futures.values():
        future.result()


def produce(
    broker: Broker,
    topic: str,
    records: list[tuple[bytes | None, bytes, list[tuple[str, bytes]] | None]],
    partition: int = 0,
) -> None:
    producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all"})
    for key, value, headers in records:
        producer.produce(topic, value, key, partition=partition, headers=headers)
    assert producer.flush(10) == 0


def avro_body(value: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(PAYMENT), value)
    return out.getvalue()


def single_object(value: dict[str, Any]) -> bytes:
    canonical = to_parsing_canonical_form(fastavro.parse_schema(PAYMENT))
    return b"\xc3\x01" + bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO")) + avro_body(value)


def confluent(value: dict[str, Any]) -> bytes:
    return b"\x00" + CONFLUENT_SCHEMA_ID.to_bytes(4, "big") + avro_body(value)


def src_registry() -> Registry:
    registry = Registry()
    registry.add_module("tests.source_workflows")
    return registry


@pytest.fixture
def settings(kafka_broker: Broker) -> KafkaSettings:
    settings = kafka_settings(kafka_broker)
    create_topics(settings, 2)
    return settings


def json_value(value: Any) -> bytes:
    return json.dumps(value).encode()


async def started(client: Client, instance: str) -> None:
    """Once a source record has started the instance (a worker that is still joining
    its group owns no partition yet: the read says so at once, and is asked again)."""
    async with asyncio.timeout(60):
        while True:
            try:
                await client.status(instance)
                return
            except (UnknownInstance, ConnectionFailed):
                await asyncio.sleep(0.05)


async def result(client: Client, instance: str) -> Any:
    """The instance's result, once a source record has started it."""
    async with asyncio.timeout(60):
        while True:
            try:
                return await client.result(instance, timeout=60)
            except (UnknownInstance, ConnectionFailed):
                await asyncio.sleep(0.05)


async def test_records_of_every_format_start_workflows_and_send_events(
    kafka_broker: Broker, settings: KafkaSettings, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:8]
    topic = {k: f"src-{k}-{run}" for k in ("orders", "header", "field", "avro", "bytes")}
    make_topics(kafka_broker, *topic.values())
    sources = [
        Source(topic["orders"], start="src-order"),
        Source(topic["header"], event="paid", instance_id="header:order-id"),
        Source(topic["field"], event="paid", instance_id="field:payment.order"),
        Source(
            topic["avro"],
            event="paid",
            instance_id="field:order_id",
            format="avro",
            schemas={CONFLUENT_SCHEMA_ID: PAYMENT},
        ),
        Source(topic["bytes"], start="src-order", format="bytes"),
    ]
    # Before the worker starts: records wait in their topics, and are read from the start.
    produce(
        kafka_broker,
        topic["orders"],
        [(f"o-{i}-{run}".encode(), json_value({"n": i, "wait": i < 4}), None) for i in range(6)],
    )
    worker = ThreadedWorker(settings, tmp_path / "w", src_registry(), sources=sources)
    try:
        worker.start()
        # Sources are read topic by topic with no order between topics: an event read
        # before its instance's start would find no instance (a dead letter). The
        # events go out once the starts are in, as they would after an order is placed.
        async with Client.connect(kafka_url(settings)) as client:
            for i in range(4):
                await started(client, f"o-{i}-{run}")
        produce(
            kafka_broker,
            topic["header"],
            [(None, json_value({"amount": 10}), [("order-id", f"o-0-{run}".encode())])],
        )
        produce(
            kafka_broker,
            topic["field"],
            [(b"ignored", json_value({"payment": {"order": f"o-1-{run}", "amount": 11}}), None)],
        )
        produce(
            kafka_broker,
            topic["avro"],
            [
                (None, single_object({"order_id": f"o-2-{run}", "amount": 12.5}), None),
                (None, confluent({"order_id": f"o-3-{run}", "amount": 13.5}), None),
            ],
        )
        raw = bytes(range(256))
        produce(kafka_broker, topic["bytes"], [(f"b-{run}".encode(), raw, None)])
        async with Client.connect(kafka_url(settings)) as client:
            assert await result(client, f"o-0-{run}") == {
                "input": {"n": 0, "wait": True},
                "paid": {"amount": 10},
            }
            assert (await result(client, f"o-1-{run}"))["paid"] == {
                "payment": {"order": f"o-1-{run}", "amount": 11}
            }
            assert (await result(client, f"o-2-{run}"))["paid"] == {
                "order_id": f"o-2-{run}",
                "amount": 12.5,
            }
            assert (await result(client, f"o-3-{run}"))["paid"]["amount"] == 13.5
            for i in (4, 5):
                assert await result(client, f"o-{i}-{run}") == {"input": {"n": i, "wait": False}}
            got = await result(client, f"b-{run}")
            assert base64.b64decode(got["input"]) == raw
            history = await client.history(f"o-0-{run}")
            assert history[0].command_id == f"{topic['orders']}/0/0"
        await lag_drains(worker, {(t, p) for t in topic.values() for p in (0, 1)})
    finally:
        worker.stop()


async def lag_drains(worker: ThreadedWorker, partitions: set[tuple[str, int]]) -> None:
    """Every source partition is assigned and reports 0 records of lag."""
    lag = worker.worker.source_lag
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        now = lag.records()
        if set(now) == partitions and not any(now.values()):
            return
        assert asyncio.get_running_loop().time() < deadline, f"lag stays {now}"
        await asyncio.sleep(0.1)


async def test_unreadable_records_go_to_dead_letters_and_the_records_after_them_run(
    kafka_broker: Broker, settings: KafkaSettings, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:8]
    orders, paid, avro = f"src-dl-orders-{run}", f"src-dl-paid-{run}", f"src-dl-avro-{run}"
    make_topics(kafka_broker, orders, paid, avro)
    sources = [
        Source(orders, start="src-order", instance_id="field:id"),
        Source(paid, event="paid"),
        Source(avro, start="src-order", format="avro", schemas=[PAYMENT]),
        Source(f"src-dl-missing-{run}", start="src-order"),  # never created: the rest go on
    ]
    produce(
        kafka_broker,
        orders,
        [
            (None, b"{not json", None),
            (None, json_value({"id": f"ok-1-{run}"}), None),
            (None, json_value({"order": 1}), None),
            (None, json_value({"id": "bad\u0001id"}), None),
            (None, json_value({"id": f"ok-2-{run}"}), None),
        ],
    )
    produce(kafka_broker, paid, [(f"nobody-{run}".encode(), json_value(1), None)])
    produce(
        kafka_broker,
        avro,
        [
            (b"a-1", b"\xc3\x01" + b"\x00" * 8 + b"junk", None),  # an unknown schema
            (b"a-2", confluent({"order_id": "x", "amount": 1.0}), None),  # no schema id 7
            (f"a-3-{run}".encode(), single_object({"order_id": "y", "amount": 2.0}), None),
        ],
    )
    worker = ThreadedWorker(settings, tmp_path / "w", src_registry(), sources=sources)
    try:
        worker.start()
        async with Client.connect(kafka_url(settings)) as client:
            assert await result(client, f"ok-1-{run}") == {"input": {"id": f"ok-1-{run}"}}
            assert await result(client, f"ok-2-{run}") == {"input": {"id": f"ok-2-{run}"}}
            assert (await result(client, f"a-3-{run}"))["input"]["amount"] == 2.0
        letters: dict[tuple[str, int, int], str] = {}
        deadline = asyncio.get_running_loop().time() + 30
        while len(letters) < 6:
            assert asyncio.get_running_loop().time() < deadline, letters
            for record in read_topic(settings, "dead-letters"):
                kind, body = decode(record.value)
                assert kind == "DeadLetter"
                letters[(body["source_topic"], body["partition"], body["offset"])] = body["reason"]
            await asyncio.sleep(0.2)
        reasons = {key: letters[key] for key in sorted(letters) if key[0] != settings.prefix}
        assert "bad JSON" in reasons[(orders, 0, 0)]
        assert "missing correlation field 'id'" in reasons[(orders, 0, 2)]
        assert "invalid instance id in field 'id'" in reasons[(orders, 0, 3)]
        assert "none of the Source's schemas" in reasons[(avro, 0, 0)]
        assert "schema id 7" in reasons[(avro, 0, 1)]
        # An event for an instance nobody started is refused by its partition's owner
        # (the command, whose id is the record's coordinates, kept as it came).
        [unknown] = [
            body
            for body in (decode(r.value)[1] for r in read_topic(settings, "dead-letters"))
            if body["source_topic"] == settings.prefix + ".commands"
        ]
        assert "needs an instance started" in unknown["reason"]
        assert default_serde().decode(unknown["value"]).command_id == f"{paid}/0/0"
        await lag_drains(worker, {(t, p) for t in (orders, paid, avro) for p in (0, 1)})
    finally:
        worker.stop()


async def test_a_record_too_large_to_keep_is_dead_lettered_without_its_value(
    kafka_broker: Broker, settings: KafkaSettings, tmp_path: Path
) -> None:
    """A source topic may take larger records than the dead-letters topic: such a record
    is refused (over the payload limit) and its dead letter keeps its coordinates, not
    its value, which the dead-letters topic would refuse, stopping the sources."""
    run = uuid.uuid4().hex[:8]
    big = f"src-big-{run}"
    admin = AdminClient({"bootstrap.servers": kafka_broker.bootstrap})
    topic = NewTopic(big, 1, 1, config={"max.message.bytes": str(4 * 1024 * 1024)})
    for future in admin.create_topics([topic], request_timeout=30).values():
        future.result()
    huge = json_value({"id": f"big-{run}", "blob": "x" * (2 * 1024 * 1024)})
    producer = Producer(
        {"bootstrap.servers": kafka_broker.bootstrap, "message.max.bytes": 4 * 1024 * 1024}
    )
    producer.produce(big, huge, None, partition=0)
    producer.produce(big, json_value({"id": f"after-{run}"}), None, partition=0)
    assert producer.flush(10) == 0
    sources = [Source(big, start="src-order", instance_id="field:id")]
    worker = ThreadedWorker(settings, tmp_path / "w", src_registry(), sources=sources)
    try:
        worker.start()
        async with Client.connect(kafka_url(settings)) as client:
            assert await result(client, f"after-{run}") == {"input": {"id": f"after-{run}"}}
        [letter] = [
            body
            for body in (decode(r.value)[1] for r in read_topic(settings, "dead-letters"))
            if body["source_topic"] == big
        ]
        assert letter["offset"] == 0 and letter["value"] == b""
        assert "PayloadTooLarge" in letter["reason"]
        assert f"is too large to keep here: read it at {big}/0/0" in letter["reason"]
    finally:
        worker.stop()


def doc_snippets() -> list[str]:
    """The Python blocks of docs/kafka.md's section on event sources, in order."""
    text = (REPO / "docs" / "kafka.md").read_text()
    section = text.split("## Kafka topics as event sources", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


async def test_the_documented_example_runs_on_a_worker_that_finds_its_sources(
    kafka_broker: Broker, settings: KafkaSettings, tmp_path: Path
) -> None:
    from tests.faults.test_kafka_failover import WorkerProcess

    make_topics(kafka_broker, *(s.topic for s in (orders_source.orders, orders_source.payments)))
    order_id = f"o-{uuid.uuid4().hex[:8]}"
    _declaration, create, order, payment = (
        block.replace("kafka:9092", kafka_broker.bootstrap).replace("o-17", order_id)
        for block in doc_snippets()
    )
    # The page creates the example's topics first (make_topics did: other tests share them).
    assert all(f'"{s.topic}"' in create for s in (orders_source.orders, orders_source.payments))
    worker = WorkerProcess(
        settings,
        tmp_path / "w",
        tmp_path,
        tmp_path / "worker.log",
        workflows="examples.orders_source",
    )
    worker.start()  # `stepstream worker --workflows examples.orders_source`, as shown
    try:
        scope: dict[str, Any] = {}
        exec(order, scope)
        async with Client.connect(kafka_url(settings)) as client:
            await started(client, order_id)
            exec(payment, scope)
            assert await result(client, order_id) == {
                "order": order_id,
                "items": ["book", "pen"],
                "paid": 25,
            }
    finally:
        worker.stop()


DEV_MODULE = """
from stepstream import Source, workflow

@workflow("greet")
async def greet(ctx, value):
    return {"hello": value["name"]}

names = Source("TOPIC", start=greet, instance_id="header:greeting-id")
"""


async def test_stepstream_dev_reads_sources_from_the_cluster_it_is_given(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    from tests.dev_server import clean_env, start_dev

    run = uuid.uuid4().hex[:8]
    topic = f"src-dev-{run}"
    make_topics(kafka_broker, topic)
    produce(
        kafka_broker,
        topic,
        [
            (None, json_value({"name": "ada"}), [("greeting-id", f"g-{run}".encode())]),
            (None, b"nope", [("greeting-id", b"never")]),
        ],
    )
    env = clean_env(
        tmp_path,
        STEPSTREAM_SOURCES_BOOTSTRAP=kafka_broker.bootstrap,
        STEPSTREAM_PREFIX=f"dev{run}",
        STEPSTREAM_KAFKA_SESSION_TIMEOUT_MS="2000",
    )
    server = start_dev(tmp_path, f"greetings_{run}", DEV_MODULE.replace("TOPIC", topic), env=env)
    try:
        async with Client.connect(server.url) as client:
            assert await result(client, f"g-{run}") == {"hello": "ada"}
    finally:
        server.stop()
    # The unreadable record is in the embedded log's dead letters, with its coordinates.
    db = await EmbeddedDB.open(str(tmp_path / "data"), None)
    try:
        letters = [
            SERDE.decode(entry.value)
            for partition in range(db.partitions)
            for entry in db.log.read(DEAD_LETTERS, partition, 0, 100)
        ]
    finally:
        await db.close()
    assert [(d.source_topic, d.partition, d.offset) for d in letters] == [(topic, 0, 1)]
    assert "bad JSON" in letters[0].reason


async def test_two_workers_split_the_source_partitions_and_each_record_runs_once(
    kafka_broker: Broker, settings: KafkaSettings, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex[:8]
    topic = f"src-two-{run}"
    make_topics(kafka_broker, topic)
    sources = [Source(topic, start="src-order")]
    first = ThreadedWorker(settings, tmp_path / "a", src_registry(), sources=sources)
    second = ThreadedWorker(settings, tmp_path / "b", src_registry(), sources=sources)
    try:
        first.start()
        second.start(partitions=None)
        deadline = asyncio.get_running_loop().time() + 30
        while not all(len(w.worker.source_lag.records()) == 1 for w in (first, second)):
            assert asyncio.get_running_loop().time() < deadline, "the sources never split"
            await asyncio.sleep(0.1)
        ids = {p: [f"two-{p}-{i}-{run}" for i in range(5)] for p in (0, 1)}
        for partition, names in ids.items():
            produce(
                kafka_broker,
                topic,
                [(n.encode(), json_value({"p": partition}), None) for n in names],
                partition,
            )
        async with Client.connect(kafka_url(settings)) as client:
            for partition, names in ids.items():
                for name in names:
                    assert await result(client, name) == {"input": {"p": partition}}
                    starts = [h for h in await client.history(name) if h.type == "WorkflowStarted"]
                    assert [h.command_id for h in starts] == [
                        f"{topic}/{partition}/{names.index(name)}"
                    ]
    finally:
        second.stop()
        first.stop()
