"""Many sleepers evicted from memory, woken by timers that come due together: each is
read back from the state store (in batches: one multi-get and one ordered scan for all
the instances a batch of fires touches) and goes on with its own state, its step's
result, its input and the event sent to it while it slept, on both backends."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from stepstream import Client
from stepstream.consumers.partition import ProcessorConfig
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from tests.conftest import ThreadedWorker, kafka_settings, kafka_url
from tests.conftest import test_registry as registry

SLEEPERS = 120
PARTITIONS = 2
CACHE = 3  # live instances per partition: all but a few sleepers are evicted
# From the first start to the shared wake time: room to start them all and send each its
# event while every one sleeps.
LEAD_S = {"embedded": 6.0, "kafka": 15.0}


@asynccontextmanager
async def engine(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Client]:
    if backend == "embedded":
        config = EmbeddedConfig(
            data_dir=str(tmp_path / "data"), partitions=PARTITIONS, cache_size=CACHE
        )
        opened = await open_embedded(registry(), config)
        async with Client(opened.make_transport(owns_engine=True)) as client:
            yield client
        return
    from stepstream.consumers.kafka import create_topics

    settings = kafka_settings(request.getfixturevalue("kafka_broker"))
    create_topics(settings, PARTITIONS)
    worker = ThreadedWorker(
        settings, tmp_path / "worker", registry(), processor=ProcessorConfig(cache_size=CACHE)
    )
    try:
        worker.start(PARTITIONS)
        async with Client.connect(kafka_url(settings)) as client:
            yield client
    finally:
        worker.stop()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["embedded", "kafka"])
async def test_evicted_sleepers_woken_together_each_resume_with_their_own_state(
    backend: str, tmp_path: Path, replays: Counter[str], request: pytest.FixtureRequest
) -> None:
    until = datetime.now(UTC) + timedelta(seconds=LEAD_S[backend])
    ids = [f"sleeper-{n}" for n in range(SLEEPERS)]
    async with engine(backend, tmp_path, request) as client:
        await asyncio.gather(
            *(
                client.start(
                    "nap-then-mail",
                    {"n": n, "until": until.isoformat(), "note": "é" * n},
                    instance_id=instance,
                )
                for n, instance in enumerate(ids)
            )
        )
        await asyncio.gather(
            *(client.send_event(instance, "mail", {"to": instance}) for instance in ids)
        )
        early = [
            s.instance_id for s in [await client.status(i) for i in ids] if s.status != "running"
        ]
        assert not early, f"finished before the shared wake time: {early}"
        results = await asyncio.gather(*(client.result(i, timeout=120) for i in ids))
        woke = datetime.now(UTC)
    assert woke >= until
    for n, (instance, result) in enumerate(zip(ids, results, strict=True)):
        assert result == {"n": n, "tag": n + 1000, "mail": {"to": instance}, "note": "é" * n}, (
            instance,
            result,
        )
    # The cache of a few per partition made almost every sleeper leave memory: they were
    # read back from the store to wake.
    reloaded = [i for i in ids if replays[i]]
    assert len(reloaded) >= SLEEPERS - PARTITIONS * CACHE, dict(replays)
