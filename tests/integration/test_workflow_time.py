"""A new instance's clock starts when its start was taken (docs/workflows.md, "Workflow
time"): ``ctx.now()`` before the code first waits, and a sleep begun there, count from
that moment, not from when the engine got round to the start. Through the public
client, on the embedded engine and on a Kafka worker."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from stepstream.engine.wire.codec import JsonCodec
from stepstream.engine.wire.records import StartWorkflow
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import partition_for
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests.conftest import KAFKA_TEST_PARTITIONS, ThreadedWorker, kafka_url
from tests.conftest import test_registry as workflows_registry
from tests.integration.test_kafka_backend import produce_raw

NAP_S = 0.3
BURST = 300


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def iso_ms(text: str) -> int:
    return round(datetime.fromisoformat(text).timestamp() * 1000)


async def nap_record(client: Client, instance: str) -> tuple[int, int]:
    """(when the engine recorded the sleep, when it is due) from the instance's history."""
    (nap,) = [h for h in await client.history(instance) if h.type == "SleepStarted"]
    return iso_ms(nap.time), nap.attributes["wake_at_ms"]


async def test_a_burst_of_starts_sleeps_from_when_each_start_was_taken(tmp_path: Path) -> None:
    engine = await open_embedded(
        workflows_registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    )
    async with Client(engine.make_transport(owns_engine=True)) as client:
        window: dict[str, tuple[int, int]] = {}

        async def start(i: int) -> str:
            called = now_ms()
            instance = await client.start("started-clock", NAP_S, instance_id=f"burst-{i}")
            window[instance] = (called, now_ms())
            return instance

        ids = await asyncio.gather(*(start(i) for i in range(BURST)))
        results: list[Any] = await asyncio.gather(*(client.result(i, timeout=30) for i in ids))
        waited = []
        for instance, result in zip(ids, results, strict=True):
            called, acknowledged = window[instance]
            began, woke = result["began_ms"], result["woke_ms"]
            # The clock began when the start was taken: inside the call, whenever the
            # engine applied it.
            assert called <= began <= acknowledged, (instance, called, began, acknowledged)
            recorded, due = await nap_record(client, instance)
            assert due == began + round(NAP_S * 1000), (instance, began, due)
            assert woke >= due, f"{instance} woke {due - woke} ms early"
            waited.append(recorded - began)
        # The engine got to some starts of the burst later than they were taken; their
        # sleeps did not wait that long again.
        assert max(waited) > 0, waited


async def test_on_kafka_a_client_clock_that_runs_late_does_not_shorten_a_sleep(
    kafka_worker: ThreadedWorker,
) -> None:
    """The worker counts from the broker's stamp (the commands topic is created with
    message.timestamp.type=LogAppendTime), never from the client's own."""
    settings = kafka_worker.settings
    instance = f"skewed-{uuid.uuid4().hex[:8]}"
    an_hour_late = now_ms() - 3_600_000
    start = StartWorkflow(
        instance_id=instance,
        command_id=str(uuid.uuid4()),
        time_ms=an_hour_late,
        workflow="started-clock",
        input=JsonCodec().encode(NAP_S),
    )
    sent = now_ms()
    produce_raw(
        settings,
        "commands",
        [
            (
                partition_for(instance, KAFKA_TEST_PARTITIONS),
                instance.encode(),
                default_serde().encode(start),
            )
        ],
    )
    async with Client.connect(kafka_url(settings)) as client:
        result = await client.result(instance, timeout=30)
        recorded, due = await nap_record(client, instance)
    assert sent <= result["began_ms"] <= recorded, (sent, result, recorded)
    assert due == result["began_ms"] + round(NAP_S * 1000)
    assert result["woke_ms"] >= sent + round(NAP_S * 1000)
