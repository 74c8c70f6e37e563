"""A schedule on Kafka when its owner is killed (kill -9) and a new worker, with empty
state, takes its partitions: every slot from the first on still has exactly one
instance, those it was down over included, and the schedule goes on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path

import pytest

from stepstream.engine.config.kafka import KafkaSettings
from stepstream.producers.client import Client
from stepstream.producers.kafka.members import MembersView
from tests.conftest import kafka_url
from tests.faults.test_kafka_failover import fresh_cluster, members, owned_by, until
from tests.kafka_broker import Broker

__all__ = ["members"]  # the fixture, shared with the failover tests

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


async def slot_seconds(client: Client, name: str) -> list[float]:
    page = await client.list_page(prefix=f"{name}@", limit=500)
    return sorted(
        datetime.fromisoformat(i.instance_id.split("@")[1]).timestamp() for i in page.instances
    )


async def test_a_new_owner_goes_on_with_one_instance_per_slot(
    kafka_broker: Broker,
    tmp_path: Path,
    members: Callable[[KafkaSettings], Awaitable[MembersView]],
) -> None:
    partitions = 2
    settings, _, (first, second) = await fresh_cluster(kafka_broker, tmp_path, partitions, "a", "b")
    view = await members(settings)
    try:
        await asyncio.to_thread(first.start)
        await owned_by(view, partitions, lambda o: set(o.values()) == {first.url} and len(o) == 2)
        async with Client.connect(kafka_url(settings)) as client:
            await client.create_schedule("s", "arith", every=1, input=1, overlap="allow")

            async def started(n: int) -> bool:
                try:
                    return (await client.describe_schedule("s")).started >= n
                except Exception:
                    return False

            await until(lambda: started(3), "three slots started", timeout=30)
            first.kill()
            await asyncio.sleep(2)  # slots pass with no owner
            await asyncio.to_thread(second.start)
            await owned_by(
                view, partitions, lambda o: set(o.values()) == {second.url} and len(o) == 2
            )
            before = (await client.describe_schedule("s")).started
            await until(lambda: started(before + 3), "slots after the failover", timeout=40)
            info = await client.describe_schedule("s")
            assert info.skipped == 0, info

            async def listed() -> bool:
                # A start the schedule recorded is applied by its child's partition, which
                # may be behind on a loaded machine: every one must show up, none twice.
                return len(await slot_seconds(client, "s")) >= info.started

            await until(listed, f"the {info.started} slot instances listed", timeout=30)
            seconds = await slot_seconds(client, "s")
            assert seconds == [seconds[0] + n for n in range(len(seconds))], seconds
    finally:
        first.kill()
        second.stop()
