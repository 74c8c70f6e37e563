"""``ctx.publish``: records produced to a user topic from workflow code, read back with a
plain confluent-kafka consumer, on the embedded backend (``STEPSTREAM_OUTBOX_BOOTSTRAP``)
and on a Kafka worker (its own cluster); bad input, a missing topic, a cluster that is
not configured, and a cluster that is unreachable for a while."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from stepstream import Client, HistoryEntry, WorkflowFailed
from stepstream.engine.api.workflow import Registry
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from tests.conftest import KAFKA_TEST_PARTITIONS, ThreadedWorker, kafka_settings, kafka_url
from tests.dev_server import clean_env, run_cli
from tests.kafka_broker import Broker

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Publishing to Kafka from a workflow (outbox)"
TOPIC_PARTITIONS = 3


@dataclass(frozen=True)
class Record:
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]
    partition: int
    offset: int

    @property
    def id(self) -> str:
        return self.headers["stepstream-id"].decode()


def outbox_registry() -> Registry:
    registry = Registry()
    registry.add_module("tests.outbox_workflows")
    return registry


def create_topic(bootstrap: str, topic: str, partitions: int = TOPIC_PARTITIONS) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result(timeout=30)


def read_topic(bootstrap: str, topic: str) -> list[Record]:
    """Every record of ``topic``, partition by partition, to its end (read once what was
    published is acknowledged: every copy produced is there by then)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "fetch.wait.max.ms": 5,
        },
        logger=None,
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        open_partitions, records = set(partitions), []
        while open_partitions:
            msg = consumer.poll(10)
            assert msg is not None, f"reading {topic} stalled"
            err = msg.error()
            if err is not None:
                assert err.code() == KafkaError._PARTITION_EOF, err.str()
                open_partitions.discard(msg.partition() or 0)
                continue
            headers = {k: v for k, v in msg.headers() or () if v is not None}
            records.append(
                Record(
                    msg.key(), msg.value() or b"", headers, msg.partition() or 0, msg.offset() or 0
                )
            )
        return records
    finally:
        consumer.close()


def first_of_each_id(records: list[Record]) -> dict[str, Record]:
    """What a consumer that drops ids it has seen keeps."""
    seen: dict[str, Record] = {}
    for record in records:
        seen.setdefault(record.id, record)
    return seen


async def wait_for_history(
    client: Client, instance: str, what: str, found: Any, timeout: float = 30
) -> list[HistoryEntry]:
    deadline = time.monotonic() + timeout
    while True:
        history = await client.history(instance)
        if any(found(entry) for entry in history):
            return history
        if time.monotonic() > deadline:
            pytest.fail(f"{instance}: no {what} in its history:\n{history}")
        await asyncio.sleep(0.1)


@pytest.fixture
def topic(kafka_broker: Broker) -> str:
    name = f"orders-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_broker.bootstrap, name)
    return name


@pytest.fixture(params=["embedded", "kafka"])
async def outbox_client(
    request: pytest.FixtureRequest, kafka_broker: Broker, tmp_path: Path
) -> AsyncIterator[Client]:
    """A client of either backend whose ``ctx.publish`` goes to the test broker."""
    if request.param == "kafka":
        from stepstream.consumers.kafka import create_topics

        settings = kafka_settings(kafka_broker)
        await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
        worker = ThreadedWorker(settings, tmp_path / "worker", outbox_registry())
        try:
            await asyncio.to_thread(worker.start)
            async with Client.connect(kafka_url(settings)) as client:
                yield client
        finally:
            await asyncio.to_thread(worker.stop)
        return
    config = EmbeddedConfig(
        data_dir=str(tmp_path / "data"), partitions=2, outbox_bootstrap=kafka_broker.bootstrap
    )
    engine = await open_embedded(outbox_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        yield client


@pytest.mark.kafka
async def test_publish_produces_value_key_and_headers_with_a_distinct_id_per_call(
    outbox_client: Client, kafka_broker: Broker, topic: str
) -> None:
    instance = await outbox_client.start(
        "outbox-order", {"topic": topic, "total": 25}, instance_id="o-1"
    )
    result = await outbox_client.result(instance, timeout=60)
    # Repeats of one name, a scope and the iterations of a ctx.loop: each its own key.
    keys = [f"publish:{topic}", f"publish:{topic}#2", f"publish:{topic}#3"]
    keys += [f"ship/publish:{topic}", f"remind/0/publish:{topic}", f"remind/1/publish:{topic}"]
    assert result["ids"] == [f"o-1/{key}" for key in keys]

    records = await asyncio.to_thread(read_topic, kafka_broker.bootstrap, topic)
    by_id = {r.id: r for r in records}
    assert len(records) == 6 and sorted(by_id) == sorted(result["ids"]), records
    first = by_id[f"o-1/publish:{topic}"]
    assert json.loads(first.value) == {"order": "o-1", "total": 25}
    assert first.key == b"o-1"
    assert first.headers == {
        "stepstream-id": f"o-1/publish:{topic}".encode(),
        "kind": b"confirmed",
        "raw": b"\x00\x01",
    }
    assert result["first"] == [topic, first.partition, first.offset]
    assert [by_id[f"o-1/{k}"].value for k in keys[1:3]] == [b"line 0", b"line 1"]
    assert {by_id[f"o-1/{k}"].key for k in keys[1:3]} == {b"lines"}
    assert json.loads(by_id[f"o-1/{keys[3]}"].value) == {"shipped": True}
    assert by_id[f"o-1/{keys[3]}"].key is None
    assert [json.loads(by_id[f"o-1/{k}"].value) for k in keys[4:]] == [
        {"reminder": 0},
        {"reminder": 1},
    ]

    # A publish is a step: its attempt is durable before it runs, its landing recorded.
    history = await outbox_client.history(instance)
    started = [h.attributes["key"] for h in history if h.type == "StepAttemptStarted"]
    succeeded = [h for h in history if h.type == "StepSucceeded"]
    assert started == keys and [h.attributes["key"] for h in succeeded] == keys
    assert succeeded[0].attributes["result"]["offset"] == first.offset


async def test_bad_publishes_fail_the_workflow_with_a_clear_error(tmp_path: Path) -> None:
    engine = await open_embedded(
        outbox_registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)
    )
    expected = {
        "topic": "topic 'orders/confirmed' is not a valid Kafka topic name",
        "value": "the value cannot be encoded",
        "header": "the header 'stepstream-id' is stepstream's own",
        # A valid publish on an engine with no cluster to publish to.
        "orders": "set STEPSTREAM_OUTBOX_BOOTSTRAP=HOST:PORT",
    }
    async with Client(engine.make_transport(owns_engine=True)) as client:
        for case, message in expected.items():
            instance = await client.start("outbox-bad", case, instance_id=f"bad-{case}")
            with pytest.raises(WorkflowFailed) as failed:
                await client.result(instance, timeout=30)
            assert message in str(failed.value), (case, str(failed.value))
        # Refused at the call: nothing was recorded, nothing was tried.
        history = await client.history("bad-topic")
        assert not [h for h in history if h.type.startswith("Step")], history
        # No cluster: the step failed at once, not retried.
        history = await client.history("bad-orders")
        failures = [h.attributes for h in history if h.type == "StepFailed"]
        assert [(f["error_type"], f["next_attempt_at_ms"]) for f in failures] == [
            ("OutboxNotConfigured", None)
        ]


@pytest.mark.kafka
async def test_a_publish_to_a_missing_topic_is_retried_until_the_topic_exists(
    kafka_broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEPSTREAM_KAFKA_PRODUCER_MESSAGE_TIMEOUT_MS", "1000")
    config = EmbeddedConfig(
        data_dir=str(tmp_path / "data"), partitions=1, outbox_bootstrap=kafka_broker.bootstrap
    )
    missing = f"late-{uuid.uuid4().hex[:8]}"
    engine = await open_embedded(outbox_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        instance = await client.start("outbox-bad", missing, instance_id="late-1")
        await wait_for_history(
            client,
            instance,
            "failed attempt saying the topic is missing",
            lambda h: (
                h.type == "StepFailed"
                and f"topic {missing!r} does not exist" in h.attributes["error_message"]
                and h.attributes["next_attempt_at_ms"] is not None
            ),
        )
        await asyncio.to_thread(create_topic, kafka_broker.bootstrap, missing)
        await client.result(instance, timeout=60)
        # Metrics count a publish as the step "publish:<topic>".
        steps = engine.host.telemetry.steps
        assert steps[("outbox-bad", f"publish:{missing}", "retried")] >= 1, steps
        assert steps[("outbox-bad", f"publish:{missing}", "succeeded")] == 1, steps
    records = await asyncio.to_thread(read_topic, kafka_broker.bootstrap, missing)
    assert list(first_of_each_id(records)) == [f"late-1/publish:{missing}"], records


@pytest.fixture
def proxied_broker() -> Iterator[Any]:
    """A broker of its own that clients reach only through a TCP proxy."""
    from tests.faults.test_network_faults import broker_behind_proxy

    with broker_behind_proxy() as proxy:
        yield proxy


@pytest.mark.kafka
async def test_a_publish_while_the_cluster_is_unreachable_completes_when_it_is_back(
    proxied_broker: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = proxied_broker
    monkeypatch.setenv("STEPSTREAM_KAFKA_PRODUCER_MESSAGE_TIMEOUT_MS", "1000")
    name = "confirmed"
    await asyncio.to_thread(create_topic, proxy.address, name)
    config = EmbeddedConfig(
        data_dir=str(tmp_path / "data"), partitions=1, outbox_bootstrap=proxy.address
    )
    engine = await open_embedded(outbox_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        warm = await client.start("outbox-bad", name, instance_id="before-cut")
        await client.result(warm, timeout=30)  # the producer is connected
        proxy.blackhole(drop=True)
        instance = await client.start("outbox-bad", name, instance_id="during-cut")
        await wait_for_history(
            client,
            instance,
            "failed attempt",
            lambda h: h.type == "StepFailed" and h.attributes["next_attempt_at_ms"] is not None,
        )
        proxy.heal()
        await client.result(instance, timeout=60)
        history = await client.history(instance)
    records = await asyncio.to_thread(read_topic, proxy.address, name)
    assert sorted(first_of_each_id(records)) == [
        f"before-cut/publish:{name}",
        f"during-cut/publish:{name}",
    ], records
    landed = [h.attributes["result"] for h in history if h.type == "StepSucceeded"]
    assert len(landed) == 1 and any(
        (r.partition, r.offset) == (landed[0]["partition"], landed[0]["offset"]) for r in records
    ), (landed, records)


@pytest.mark.kafka
async def test_the_documented_example_publishes_what_it_says(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    page = (REPO / "docs" / "kafka.md").read_text()
    section = page.split(SECTION, 1)[1].split("\n##", 1)[0]
    assert "(../examples/outbox.py)" in section
    line = next(x for x in section.splitlines() if x.startswith("STEPSTREAM_OUTBOX_BOOTSTRAP="))
    words = shlex.split(line)
    assert words[1] == "stepstream", line
    # The topics, as the page creates them (its cluster's address replaced).
    create = next(x for x in section.splitlines() if x.startswith("python -c "))
    script = shlex.split(create.replace("localhost:9092", kafka_broker.bootstrap))[2]
    made = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    env = clean_env(tmp_path, STEPSTREAM_OUTBOX_BOOTSTRAP=kafka_broker.bootstrap)
    done = await asyncio.to_thread(run_cli, tmp_path, *words[2:], env=env)
    assert re.search(r"^status:\s+completed$", done.stdout, re.M), done.stdout + done.stderr
    found = re.search(r"^result:\s+(.*)$", done.stdout, re.M)
    assert found is not None, done.stdout
    result = json.loads(found.group(1))
    instance = result["id"].split("/", 1)[0]
    assert result["id"] == f"{instance}/publish:shop.orders.confirmed"
    assert result["total"] == 25

    [confirmed] = await asyncio.to_thread(
        read_topic, kafka_broker.bootstrap, "shop.orders.confirmed"
    )
    assert (confirmed.key, json.loads(confirmed.value)) == (b"o-17", {"order": "o-17", "total": 25})
    assert confirmed.headers["origin"] == b"stepstream" and confirmed.offset == result["offset"]
    shipped = await asyncio.to_thread(read_topic, kafka_broker.bootstrap, "shop.shipments")
    assert {r.id: json.loads(r.value)["item"] for r in shipped} == {
        f"{instance}/publish:shop.shipments": "pen",
        f"{instance}/publish:shop.shipments#2": "book",
    }


async def test_the_workflow_environment_keeps_what_is_published_without_kafka() -> None:
    from stepstream.testing import WorkflowEnvironment

    async with WorkflowEnvironment("tests.outbox_workflows") as env:
        order = {"topic": "orders", "total": 3}
        await env.client.start("outbox-order", order, instance_id="e-1")
        result = await env.client.result("e-1")
        assert [r.id for r in env.published] == result["ids"]
        first = env.published[0]
        assert (first.topic, first.key, json.loads(first.value)) == (
            "orders",
            b"e-1",
            {"order": "e-1", "total": 3},
        )
        assert result["first"] == ["orders", 0, 0]
        await env.crash()
        assert await env.client.result("e-1") == result
        assert len(env.published) == 6  # replay returns where they landed: none again


async def test_a_restarted_run_publishes_under_ids_of_its_own() -> None:
    """A consumer that drops ids it has seen (docs/kafka.md) must not drop the records
    of a run restarted with restart_if_failed as repeats of the failed run's."""
    from stepstream import Context, NonRetryableError, workflow
    from stepstream.engine.api.workflow import Registry
    from stepstream.testing import WorkflowEnvironment

    def check(outcome: str) -> None:
        if outcome == "fail":
            raise NonRetryableError("declined")

    @workflow("publish-then-check")
    async def publish_then_check(ctx: Context, outcome: str) -> str:
        published = await ctx.publish("orders", {"outcome": outcome})
        await ctx.step("check", check, outcome)
        return published.id

    registry = Registry()
    registry.add(publish_then_check)
    async with WorkflowEnvironment(registry) as env:
        await env.client.start("publish-then-check", "fail", instance_id="p-1")
        await env.settle()
        assert (await env.client.status("p-1")).status == "failed"
        await env.client.start(
            "publish-then-check", "ok", instance_id="p-1", if_exists="restart_if_failed"
        )
        assert await env.client.result("p-1") == "p-1/run2/publish:orders"
        assert [r.id for r in env.published] == ["p-1/publish:orders", "p-1/run2/publish:orders"]
