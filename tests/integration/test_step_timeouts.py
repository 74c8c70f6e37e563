"""Step timeouts end to end, on both backends: sync bodies that overrun their timeout
never starve later steps of threads, and a sync body sees ``attempt_cancelled()``."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from stepstream.engine.api.workflow import Registry
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests import step_workflows
from tests.conftest import KAFKA_TEST_PARTITIONS, ThreadedWorker, kafka_settings, kafka_url


def _registry() -> Registry:
    registry = Registry()
    registry.add_module("tests.step_workflows")
    return registry


@pytest.fixture(params=["embedded", "kafka"])
async def client(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Client]:
    """A client of an engine with ``tests.step_workflows`` registered."""
    if request.param == "kafka":
        from stepstream.consumers.kafka import create_topics

        settings = kafka_settings(request.getfixturevalue("kafka_broker"))
        create_topics(settings, KAFKA_TEST_PARTITIONS)
        worker = ThreadedWorker(settings, tmp_path / "worker", _registry())
        try:
            worker.start()
            async with Client.connect(kafka_url(settings)) as c:
                yield c
        finally:
            worker.stop()
        return
    engine = await open_embedded(
        _registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    )
    async with Client(engine.make_transport(owns_engine=True)) as c:
        yield c


async def _result(client: Client, instance: str) -> Any:
    try:
        return await client.result(instance, timeout=30)
    except Exception:
        history = await client.history(instance)
        print(f"history of {instance}:", *[(h.seq, h.type, h.attributes) for h in history])
        raise


async def test_sync_bodies_overrunning_their_timeout_leave_threads_for_later_steps(
    client: Client,
) -> None:
    instance = f"overrun-{uuid.uuid4().hex[:8]}"
    try:
        await client.start("overrun-then-quick", 40, instance_id=instance)
        result = await _result(client, instance)
    finally:
        step_workflows.release(instance)
    # 40 bodies hold 40 threads past their timeout (more than the 32 the executor
    # keeps); the quick step still ran within its 2 s timeout.
    assert result == {"stuck": ["StepTimeout"], "quick": "quick"}


async def test_a_sync_body_stops_early_when_its_attempt_timed_out(client: Client) -> None:
    instance = f"polite-{uuid.uuid4().hex[:8]}"
    await client.start("polite-timeout", None, instance_id=instance)
    assert await _result(client, instance) == "attempt 2"
    failed = [h.attributes for h in await client.history(instance) if h.type == "StepFailed"]
    assert [(a["attempt"], a["error_type"]) for a in failed] == [(1, "StepTimeout")]
    # The first body noticed within its poll interval, while the retry ran.
    for _ in range(500):
        if step_workflows.seen[instance]:
            break
        await asyncio.sleep(0.01)
    assert step_workflows.seen[instance] == ["attempt 1 cancelled"]
