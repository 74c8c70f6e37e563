"""The Kafka backend against a real broker: what is on the topics, and what survives.

Topic administration through the CLI; every record Avro single-object encoded, keyed by
instance id and readable with fastavro and the ``.avsc`` files alone; timers through the
timers topic (duplicate fires harmless); dead letters; client-side rejection of bad
input before anything is published; re-processing and restore without local state.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import fastavro
import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from fastavro.schema import expand_schema, fingerprint, to_parsing_canonical_form

from stepstream import (
    InvalidPayload,
    PayloadTooLarge,
    UnknownInstance,
    UnknownWorkflow,
)
from stepstream.consumers.kafka import create_topics
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.wire.records import DeadLetter, TimerFired
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import TopicNames, partition_for
from stepstream.producers.client import Client
from tests.conftest import (
    KAFKA_TEST_OPTIONS,
    KAFKA_TEST_PARTITIONS,
    ThreadedWorker,
    kafka_settings,
    kafka_url,
)
from tests.conftest import (
    test_registry as workflows_registry,
)
from tests.integration.test_workflows import wait_for_status
from tests.kafka_broker import Broker

REPO = Path(__file__).resolve().parents[2]
SINGLE_OBJECT = b"\xc3\x01"


# ---- reading topics as any Kafka tool would --------------------------------------------


@dataclass(frozen=True)
class Rec:
    partition: int
    offset: int
    key: bytes
    value: bytes


def read_topic(settings: KafkaSettings, kind: str) -> list[Rec]:
    """Every record of ``<prefix>.<kind>``, partition by partition, to the end."""
    topic = TopicNames(settings.prefix).name(kind)
    consumer = Consumer(
        {
            "bootstrap.servers": settings.bootstrap,
            "group.id": f"reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "fetch.wait.max.ms": 5,
        }
    )
    try:
        count = len(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        consumer.assign([TopicPartition(topic, p, 0) for p in range(count)])
        open_partitions, records = set(range(count)), []
        while open_partitions:
            msg = consumer.poll(10)
            assert msg is not None, f"reading {topic} stalled"
            err = msg.error()
            if err is not None:
                assert err.code() == KafkaError._PARTITION_EOF, err.str()
                open_partitions.discard(msg.partition() or 0)
                continue
            records.append(
                Rec(msg.partition() or 0, msg.offset() or 0, msg.key() or b"", msg.value() or b"")
            )
        return records
    finally:
        consumer.close()


def produce_raw(
    settings: KafkaSettings, kind: str, records: list[tuple[int, bytes, bytes]]
) -> None:
    topic = TopicNames(settings.prefix).name(kind)
    producer = Producer({"bootstrap.servers": settings.bootstrap, "acks": "all"})
    for partition, key, value in records:
        producer.produce(topic, value, key, partition=partition)
    assert producer.flush(10) == 0


def plain_schemas() -> dict[bytes, dict[str, Any]]:
    """schemas/README.md's recipe: fastavro and the .avsc files, nothing of stepstream."""
    named: dict[str, Any] = {}
    by_fingerprint: dict[bytes, dict[str, Any]] = {}
    paths = sorted((REPO / "schemas").rglob("*.avsc"), key=lambda p: p.parts[-3] != "common")
    for path in paths:
        schema = fastavro.parse_schema(json.loads(path.read_text()), named)
        full: dict[str, Any] = expand_schema(schema)  # type: ignore[assignment]
        canonical = to_parsing_canonical_form(full)
        by_fingerprint[bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))] = full
    return by_fingerprint


SCHEMAS = plain_schemas()


def decode(value: bytes) -> tuple[str, dict[str, Any]]:
    assert value[:2] == SINGLE_OBJECT, "not Avro single-object encoding"
    schema = SCHEMAS[value[2:10]]
    body = fastavro.schemaless_reader(io.BytesIO(value[10:]), schema, None)
    assert isinstance(body, dict)
    return str(schema["name"]).rsplit(".", 1)[-1], body


def instance_on(partition: int, prefix: str = "barrier") -> str:
    while True:
        candidate = f"{prefix}-{uuid.uuid4().hex[:8]}"
        if partition_for(candidate, KAFKA_TEST_PARTITIONS) == partition:
            return candidate


async def barrier(client: Client) -> None:
    """Once this returns, every partition has processed what was on it before."""
    for partition in range(KAFKA_TEST_PARTITIONS):
        instance = await client.start("arith", 1, instance_id=instance_on(partition))
        assert await client.result(instance, timeout=20) == {"total": 2, "doubled": 4}


async def story(client: Client, instance: str) -> list[tuple[int, str, dict[str, Any]]]:
    return [(h.seq, h.type, h.attributes) for h in await client.history(instance)]


async def each_step_succeeded_once(client: Client, instances: Iterable[str]) -> None:
    for instance in instances:
        successes = Counter(
            h.attributes["key"] for h in await client.history(instance) if h.type == "StepSucceeded"
        )
        assert all(n == 1 for n in successes.values()), (instance, successes)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stepstream.ops.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


# ---- topics -------------------------------------------------------------------------------


def test_topics_create_is_idempotent_and_says_what_exists(kafka_broker: Broker) -> None:
    prefix = f"cli{uuid.uuid4().hex[:8]}"
    args = ("topics", "create", "--bootstrap", kafka_broker.bootstrap, "--prefix", prefix)
    first = cli(*args, "--partitions", "3")
    assert first.returncode == 0, first.stderr
    kinds = ("commands", "history", "timers", "dead-letters", "snapshots")
    for kind in kinds:
        assert f"created {prefix}.{kind} (3 partitions)" in first.stdout
    assert f"created {prefix}.members (1 partition)" in first.stdout
    assert f"created {prefix}.definitions (1 partition)" in first.stdout

    again = cli(*args, "--partitions", "3", "--json")
    assert again.returncode == 0, again.stderr
    rows = json.loads(again.stdout)
    assert {r["topic"]: (r["partitions"], r["created"]) for r in rows} == {
        **{f"{prefix}.{kind}": (3, False) for kind in kinds},
        f"{prefix}.members": (1, False),
        f"{prefix}.definitions": (1, False),
    }

    wrong = cli(*args, "--partitions", "5")
    assert wrong.returncode == 1
    assert f"{prefix}.commands has 3 partitions, not 5" in wrong.stderr


# ---- records on the topics ------------------------------------------------------------


async def test_history_topic_tells_the_story_with_fastavro_alone(
    kafka_worker: ThreadedWorker,
) -> None:
    settings = kafka_worker.settings
    async with Client.connect(kafka_url(settings)) as client:
        napper = await client.start(
            "nap-then-step",
            {"name": "n", "seconds": 0.2},
            instance_id=f"nap-{uuid.uuid4().hex[:6]}",
        )
        waiter = await client.start("waiter", None, instance_id=f"w-{uuid.uuid4().hex[:6]}")
        await client.send_event(waiter, "approval", {"by": "ada"})
        assert await client.result(napper, timeout=20) == "n-second"
        assert await client.result(waiter, timeout=20) == {"by": "ada"}
        expected = {i: await client.history(i) for i in (napper, waiter)}

    history = await asyncio.to_thread(read_topic, settings, "history")
    # The fold of schemas/README.md: skip records of a fenced-out owner and re-deliveries.
    rebuilt: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    fences: dict[int, int] = {}
    for rec in history:
        name, body = decode(rec.value)
        header = body["header"]
        assert rec.key.decode() == header["instance_id"]
        if name == "PartitionFenced":
            assert rec.key == b"" and body["partition"] == rec.partition
            fences[rec.partition] = max(fences.get(rec.partition, 0), header["epoch"])
            continue
        assert rec.partition == partition_for(header["instance_id"], KAFKA_TEST_PARTITIONS)
        story_ = rebuilt.setdefault(header["instance_id"], [])
        if header["epoch"] < fences.get(rec.partition, 0):
            continue
        if story_ and header["seq"] <= story_[-1][1]["header"]["seq"]:
            continue
        if name == "InstanceForgotten":
            story_.clear()
            continue
        story_.append((name, body))

    for instance, entries in expected.items():
        story_ = rebuilt[instance]
        assert [name for name, _ in story_] == [e.type for e in entries]
        assert [body["header"]["seq"] for _, body in story_] == [e.seq for e in entries]
        assert [body["header"]["command_id"] for _, body in story_] == [
            e.command_id for e in entries
        ]
    waiter_story = dict(rebuilt[waiter])
    payload = waiter_story["WaitSatisfied"]["payload"]
    assert payload["content_type"] == "application/json"
    assert json.loads(payload["data"]) == {"by": "ada"}
    assert json.loads(dict(rebuilt[napper])["WorkflowCompleted"]["result"]["data"]) == "n-second"

    # Every other topic holds single-object records keyed by instance id, on its partition.
    for kind in ("commands", "timers"):
        records = await asyncio.to_thread(read_topic, settings, kind)
        assert records, kind
        for rec in records:
            name, body = decode(rec.value)
            assert rec.key.decode() == body["header"]["instance_id"], (kind, name)
            assert rec.partition == partition_for(rec.key.decode(), KAFKA_TEST_PARTITIONS)


async def test_timers_go_through_the_timers_topic_and_duplicate_fires_are_harmless(
    kafka_worker: ThreadedWorker,
) -> None:
    settings = kafka_worker.settings
    serde = default_serde()
    async with Client.connect(kafka_url(settings)) as client:
        sleeper = await client.start("sleeper", 0.2, instance_id=f"s-{uuid.uuid4().hex[:6]}")
        retrier = await client.start(
            "retrying",
            {"key": uuid.uuid4().hex, "fail": 1, "max": 3},
            instance_id=f"r-{uuid.uuid4().hex[:6]}",
        )
        timeout = await client.start("waiter", 0.2, instance_id=f"t-{uuid.uuid4().hex[:6]}")
        assert (await client.result(sleeper, timeout=20))["slept"] >= 0.2
        assert await client.result(retrier, timeout=20) == "ok after 2"
        assert await client.result(timeout, timeout=20) == "timed out"

        scheduled = {}
        fires = []
        for rec in await asyncio.to_thread(read_topic, settings, "timers"):
            name, body = decode(rec.value)
            if name == "TimerScheduled":
                instance = body["header"]["instance_id"]
                scheduled[instance] = body["purpose"]
                fire = TimerFired(
                    instance_id=instance,
                    command_id=f"fire:{body['timer_id']}",
                    timer_id=body["timer_id"],
                    fire_at_ms=body["fire_at_ms"],
                )
                fires.append((rec.partition, rec.key, serde.encode(fire)))
        assert scheduled == {sleeper: "sleep", retrier: "retry", timeout: "wait"}
        # Each fired once: handed to the processor directly, or through the commands
        # topic when a timer came due before the processor had heard the topic's end.
        on_log = [
            rec.key.decode()
            for rec in await asyncio.to_thread(read_topic, settings, "commands")
            if decode(rec.value)[0] == "TimerFired"
        ]
        assert len(on_log) == len(set(on_log)) and set(on_log) <= {sleeper, retrier, timeout}
        before = {i: await story(client, i) for i in (sleeper, retrier, timeout)}

        # Fire every timer again, twice, and one that never existed: all harmless.
        stray = TimerFired(
            instance_id=sleeper,
            command_id="fire:stray",
            timer_id=f"{sleeper}/sleep/99/nap",
            fire_at_ms=1,
        )
        partition = partition_for(sleeper, KAFKA_TEST_PARTITIONS)
        extra = [(partition, sleeper.encode(), serde.encode(stray))]
        await asyncio.to_thread(produce_raw, settings, "commands", fires + fires + extra)
        await barrier(client)
        for instance, records in before.items():
            assert await story(client, instance) == records, instance


async def test_a_timer_due_while_the_worker_is_caught_up_fires_without_the_commands_topic(
    kafka_worker: ThreadedWorker,
) -> None:
    settings = kafka_worker.settings
    async with Client.connect(kafka_url(settings)) as client:
        sleeper = await client.start("sleeper", 0.5, instance_id=f"d-{uuid.uuid4().hex[:6]}")
        assert (await client.result(sleeper, timeout=20))["slept"] >= 0.5
        elapsed = [h for h in await client.history(sleeper) if h.type == "SleepElapsed"]
    # The fire is in the history (any Kafka tool reads it there), once, caused by the
    # timer; the commands topic never saw it.
    assert len(elapsed) == 1
    assert elapsed[0].command_id.startswith(f"fire:{sleeper}/sleep/")
    on_log = [
        rec
        for rec in await asyncio.to_thread(read_topic, settings, "commands")
        if rec.key == sleeper.encode() and decode(rec.value)[0] == "TimerFired"
    ]
    assert on_log == []


async def test_undecodable_command_goes_to_dead_letters_and_the_partition_moves_on(
    kafka_worker: ThreadedWorker,
) -> None:
    settings = kafka_worker.settings
    junk = instance_on(0, "junk")
    garbage = [
        (0, junk.encode(), b"\x00not a record"),
        (0, junk.encode(), SINGLE_OBJECT + b"\x01" * 8),
    ]
    await asyncio.to_thread(produce_raw, settings, "commands", garbage)
    async with Client.connect(kafka_url(settings)) as client:
        await barrier(client)  # partition 0 processed both, then went on
        with pytest.raises(UnknownInstance):
            await client.status(junk)

    letters = [
        default_serde().decode(rec.value)
        for rec in await asyncio.to_thread(read_topic, settings, "dead-letters")
    ]
    assert len(letters) == 2
    for letter, (_, key, value) in zip(letters, garbage, strict=True):
        assert isinstance(letter, DeadLetter)
        assert letter.source_topic == TopicNames(settings.prefix).commands
        assert letter.partition == 0
        assert (letter.key, letter.value) == (key, value)
        assert letter.reason.startswith("undecodable record"), letter.reason


async def test_client_rejects_bad_input_before_anything_is_published(
    kafka_worker: ThreadedWorker,
) -> None:
    settings = kafka_worker.settings
    async with Client.connect(kafka_url(settings)) as client:
        with pytest.raises(UnknownWorkflow, match=r"nope.*known workflows: (.*, )?arith"):
            await client.start("nope", {})
        with pytest.raises(InvalidPayload, match="not JSON-encodable"):
            await client.start("arith", {"x": object()})
        with pytest.raises(PayloadTooLarge, match="over the limit"):
            await client.start("arith", "x" * (1024 * 1024 + 1))
    bad_json = await asyncio.to_thread(
        cli, "start", "arith", "--input", "{bad", "--connect", kafka_url(settings)
    )
    assert bad_json.returncode == 2 and "not valid JSON" in bad_json.stderr
    unknown = await asyncio.to_thread(cli, "start", "nope", "--connect", kafka_url(settings))
    assert unknown.returncode == 1 and "unknown workflow 'nope'" in unknown.stderr
    assert await asyncio.to_thread(read_topic, settings, "commands") == []


async def test_command_for_unknown_instance_is_refused_by_its_owner_and_kept(
    kafka_worker: ThreadedWorker,
) -> None:
    """A kafka:// client publishes without asking first (one round trip less per
    command); the owner dead-letters it and the client raises UnknownInstance."""
    settings = kafka_worker.settings
    async with Client.connect(kafka_url(settings)) as client:
        with pytest.raises(UnknownInstance, match="ghost"):
            await client.send_event("ghost", "approval", 1)
    letters = await asyncio.to_thread(read_topic, settings, "dead-letters")
    decoded = [default_serde().decode(r.value) for r in letters]
    assert all(isinstance(d, DeadLetter) for d in decoded)
    assert [(d.instance_id, d.reason.split(":")[0]) for d in decoded] == [  # type: ignore[attr-defined]
        ("ghost", "unknown instance 'ghost'")
    ]


# ---- re-processing and restore -----------------------------------------------------------


def reset_group_offsets(settings: KafkaSettings) -> None:
    """What an operator does with kafka-consumer-groups --reset-offsets --to-earliest."""
    names = TopicNames(settings.prefix)
    consumer = Consumer(
        {
            "bootstrap.servers": settings.bootstrap,
            "group.id": f"{settings.prefix}.workers",
            "enable.auto.commit": False,
        }
    )
    try:
        offsets = [
            TopicPartition(topic, p, 0)
            for topic in (names.commands, names.timers)
            for p in range(KAFKA_TEST_PARTITIONS)
        ]
        consumer.commit(offsets=offsets, asynchronous=False)
        committed = consumer.committed(offsets, timeout=10)
        assert [tp.offset for tp in committed] == [0] * len(offsets)
    finally:
        consumer.close()


async def test_reprocessing_is_idempotent_and_an_empty_state_dir_restores(
    kafka_broker: Broker, tmp_path: Path, ledger: Path
) -> None:
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
    worker = ThreadedWorker(settings, tmp_path / "first", workflows_registry())
    await asyncio.to_thread(worker.start)
    second: ThreadedWorker | None = None
    try:
        async with Client.connect(kafka_url(settings)) as client:
            finished: dict[str, Any] = {}
            for workflow, arg in [
                ("arith", 3),
                ("chain", 6),
                ("chain", 70),  # more commands than the in-memory window of recent ids
                ("retrying", {"key": uuid.uuid4().hex, "fail": 1, "max": 3}),
                ("sleeper", 0.1),
                ("parallel", 4),
                ("values", None),
            ]:
                instance = await client.start(
                    workflow, arg, instance_id=f"{workflow}-{uuid.uuid4().hex[:6]}"
                )
                finished[instance] = await client.result(instance, timeout=20)
            events = await client.start(
                "two-events", None, instance_id=f"ev-{uuid.uuid4().hex[:6]}"
            )
            await client.send_event(events, "item", "a")
            await client.send_event(events, "item", "b")
            finished[events] = await client.result(events, timeout=20)
            # A re-delivered event must not be claimed again by a later wait.
            twice = await client.start(
                "event-steps-event", 70, instance_id=f"twice-{uuid.uuid4().hex[:6]}"
            )
            await client.send_event(twice, "item", "first")
            for _ in range(500):
                if [w.key for w in (await client.status(twice)).waits] == ["item-2"]:
                    break
                await asyncio.sleep(0.02)
            waiting = await client.start("gated", "g", instance_id=f"gate-{uuid.uuid4().hex[:6]}")
            napping = await client.start(
                "nap-then-step",
                {"name": "nap", "seconds": 4},
                instance_id=f"nap-{uuid.uuid4().hex[:6]}",
            )
            await asyncio.sleep(0.3)
            stories = {i: await story(client, i) for i in [*finished, twice, waiting, napping]}

            # 1. The same commands again, byte for byte: nothing changes.
            commands = await asyncio.to_thread(read_topic, settings, "commands")
            copies = [(r.partition, r.key, r.value) for r in commands]
            await asyncio.to_thread(produce_raw, settings, "commands", copies)
            await barrier(client)
            for instance, expected in stories.items():
                now = await story(client, instance)
                if instance == napping:
                    now = now[: len(expected)]
                assert now == expected, instance
            await client.send_event(twice, "item", "second")
            finished[twice] = await client.result(twice, timeout=20)
            assert finished[twice] == ["first", 70, "second"]
            stories[twice] = await story(client, twice)

            # 2. A worker without local state, and the group's offsets back at 0 (the
            # offsets carried on the history records say where the commands resume).
            await asyncio.to_thread(worker.stop)
            shutil.rmtree(tmp_path / "first")
            await asyncio.to_thread(reset_group_offsets, settings)
            second = ThreadedWorker(settings, tmp_path / "second", workflows_registry())
            await asyncio.to_thread(second.start)
            for instance, expected in stories.items():
                now = await story(client, instance)
                if instance == napping:  # its sleep may end meanwhile: history only grows
                    now = now[: len(expected)]
                assert now == expected, instance
            for instance, result in finished.items():
                assert await client.result(instance, timeout=5) == result

            # ... and it carries on: the sleep set before the restart ends, the wait
            # takes its event, new instances run.
            await client.send_event(waiting, "go", "green")
            assert await client.result(waiting, timeout=20) == ["g-before", "green", "g-after"]
            assert await client.result(napping, timeout=20) == "nap-second"
            assert await client.result(await client.start("chain", 3), timeout=20) == 3
            await each_step_succeeded_once(client, stories)
    finally:
        if second is not None:
            await asyncio.to_thread(second.stop)
        else:
            await asyncio.to_thread(worker.stop)


async def test_a_refused_commit_stops_the_worker_and_the_next_one_recovers(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
    strict = KafkaSettings(
        settings.bootstrap,
        settings.prefix,
        {**settings.properties, "producer.message.max.bytes": "4000"},
    )
    first = ThreadedWorker(strict, tmp_path / "first", workflows_registry())
    await asyncio.to_thread(first.start)
    second: ThreadedWorker | None = None
    try:
        async with Client.connect(kafka_url(settings), command_timeout=3) as client:
            name = "n" * 6000  # its WorkflowStarted is over the worker's record limit
            instance = instance_on(0, "big")
            # Durable once the broker has it: the client does not wait for the worker.
            await client.start("gated", name, instance_id=instance)
            while first.worker.failed is None:
                await asyncio.sleep(0.05)
            assert (
                "refused" in str(first.worker.failed)
                or "too large" in str(first.worker.failed).lower()
            ), first.worker.failed
            await asyncio.to_thread(first.stop)

            second = ThreadedWorker(settings, tmp_path / "second", workflows_registry())
            await asyncio.to_thread(second.start)
            # The successor restores the instance and re-runs its first step; then it waits.
            await wait_for_status(
                client,
                instance,
                lambda s: s.status == "running" and [w.event for w in s.waits] == ["go"],
            )
            await client.send_event(instance, "go", 1)
            assert await client.result(instance, timeout=20) == [
                f"{name}-before",
                "1",
                f"{name}-after",
            ]
    finally:
        await asyncio.to_thread(first.stop)
        if second is not None:
            await asyncio.to_thread(second.stop)


async def test_worker_class_runs_a_kafka_worker_in_process(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    from stepstream import Worker

    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
    options = dict(option.split("=", 1) for option in KAFKA_TEST_OPTIONS)
    async with Worker(
        modules="tests.workflows",
        connect=kafka_url(settings),
        state_dir=str(tmp_path / "state"),
        port=0,
        kafka=options,
    ) as worker:
        assert sorted(worker.kafka.owned) == list(range(KAFKA_TEST_PARTITIONS))
        client = worker.client()
        instance = await client.start("chain", 4)
        assert await client.result(instance, timeout=20) == 4

        # The worker's plain HTTP API: a settled command, one that never was, and reads.
        [started] = [h for h in await client.history(instance) if h.type == "WorkflowStarted"]
        base = worker.kafka.url
        async with aiohttp.ClientSession() as http:
            url = f"{base}/v1/commands/{started.command_id}"
            async with http.get(url, params={"instance": instance, "timeout": "5"}) as answer:
                assert answer.status == 200
                assert await answer.json() == {
                    "command_id": started.command_id,
                    "settled": True,
                    "reason": None,
                }
            never = {"instance": instance, "timeout": "0.1"}
            async with http.get(f"{base}/v1/commands/never", params=never) as answer:
                assert answer.status == 408
                assert (await answer.json())["error"]["type"] == "ResultTimeout"
            # A command id is unique on its instance only: the wait must name it.
            async with http.get(f"{base}/v1/commands/never", params={"timeout": "0.1"}) as answer:
                assert answer.status == 400
                assert "?instance=ID" in (await answer.json())["error"]["message"]
            async with http.get(f"{base}/v1/instances/{instance}") as answer:
                assert (await answer.json())["status"] == "completed"
            # A session read may name the start it comes after (command id, offset): the
            # owner answers once it is past it, says so if it never applied it, and
            # refuses a bad one.
            ws = await http.ws_connect(f"{base}/v1/session")
            read = {"op": "status", "instance_id": instance}
            calls = [
                {"id": 1, **read, "after": started.command_id, "after_offset": 0},
                {"id": 2, "op": "result", "instance_id": instance, "after": 7},
                {"id": 3, **read, "after": "never-published", "after_offset": 0},
                {"id": 4, **read, "op": "result", "after_offset": 10**12, "timeout": 0.2},
                {"id": 5, **read, "after_offset": -1},
            ]
            await ws.send_str(json.dumps(calls))
            replies: dict[int, Any] = {}
            while len(replies) < len(calls):
                replies.update((r["id"], r) for r in await ws.receive_json(timeout=10))
            await ws.close()
            assert replies[1]["ok"]["status"] == "completed", replies
            assert replies[2]["error"]["type"] == "InvalidPayload", replies
            assert "'after' must be a command id" in replies[2]["error"]["message"]
            refused = replies[3]["error"]["message"]
            assert "never-published) was refused" in refused and "dead-letters" in refused
            assert replies[4]["error"]["type"] == "ResultTimeout", replies
            assert f"instance {instance}: its owner had not yet applied" in str(replies[4])
            assert "'after_offset' must be an offset" in replies[5]["error"]["message"]
