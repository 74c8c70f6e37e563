"""A run's timeout and terminate across a change of owner on Kafka: the worker that
owns the partitions is killed with SIGKILL and a successor on an empty state directory
restores them from the topics. The timeout's timer fires on the successor; a terminate
sent while no worker ran is applied by it, once; a restarted instance goes on with its
second run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from stepstream import WorkflowFailed, WorkflowTerminated, WorkflowTimeout
from stepstream.consumers.kafka import create_topics
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.producers.client import Client
from stepstream.producers.kafka.members import MembersView
from tests.conftest import kafka_settings, kafka_url
from tests.faults.test_kafka_failover import WorkerProcess, members, owned_by, until  # noqa: F401
from tests.kafka_broker import Broker

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

WORKFLOWS = "tests.workflows,tests.lifecycle_workflows"
LIMIT_S = 6.0  # tests.lifecycle_workflows' "slow-deadline"


async def test_timeout_terminate_and_a_restart_survive_an_owner_change(
    kafka_broker: Broker,
    tmp_path: Path,
    members: Callable[[KafkaSettings], Awaitable[MembersView]],  # noqa: F811
) -> None:
    partitions = 2
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, partitions)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    log = tmp_path / "workers.log"
    first, second = (
        WorkerProcess(settings, tmp_path / d, ledger, log, workflows=WORKFLOWS) for d in "ab"
    )
    view = await members(settings)
    try:
        await asyncio.to_thread(first.start)
        await owned_by(view, partitions, lambda o: len(o) == partitions)
        async with Client.connect(kafka_url(settings)) as client:
            began = time.monotonic()
            late = await client.start("slow-deadline", None, instance_id="late")
            stuck = await client.start("flaky-once", {"wait": True}, instance_id="stuck")
            # A second run: the successor restores it from the history topic, the first
            # run's records folded and set aside.
            again = await client.start("flaky-once", {"fail": True}, instance_id="again")
            with pytest.raises(WorkflowFailed):
                await client.result(again, timeout=30)
            await client.start(
                "flaky-once",
                {"wait": True, "n": 9},
                instance_id=again,
                if_exists="restart_if_failed",
            )

            async def both_wait() -> bool:
                statuses = [await client.status(i) for i in (late, stuck, again)]
                return all(any(w.kind == "wait" for w in s.waits) for s in statuses)

            await until(both_wait, "the instances to wait")
            first.kill()
            # Durable once the broker has it; the successor applies it.
            await client.terminate(stuck, reason="while no worker ran")

            await asyncio.to_thread(second.start)
            await owned_by(
                view, partitions, lambda o: set(o.values()) == {second.url} and len(o) == partitions
            )
            with pytest.raises(WorkflowTerminated, match="while no worker ran"):
                await client.result(stuck, timeout=30)
            with pytest.raises(WorkflowTimeout, match="within its timeout of 6 s"):
                await client.result(late, timeout=30)
            assert time.monotonic() - began >= LIMIT_S
            await client.send_event(again, "go", None)
            assert await client.result(again, timeout=30) == {"ok": 9}
            assert (await client.status(again)).run == 2

            for instance, end in ((late, "WorkflowFailed"), (stuck, "WorkflowTerminated")):
                history = await client.history(instance)
                story = [(h.seq, h.type, h.attributes) for h in history]
                types = [h.type for h in history]
                assert types.count(end) == 1 and types[-1] == end, story
                assert "CommandIgnored" not in types, story
            assert (await client.status(late)).error.startswith("WorkflowTimeout: ")  # type: ignore[union-attr]
    finally:
        first.kill()
        second.stop()
