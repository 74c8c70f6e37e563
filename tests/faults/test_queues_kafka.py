"""Queues on the Kafka backend, with two `stepstream worker` processes in one group: the
limits hold across both (from recorded admission and release times) while each worker in
turn is killed with -9 holding slots and a new one takes its place."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest

from stepstream import Client, UnknownInstance
from stepstream.consumers.kafka import OutRecord, create_topics
from stepstream.engine.api.workflow import Registry
from stepstream.engine.wire.records import WorkflowCancelledRecord
from stepstream.engine.wire.serde import default_serde
from tests.conftest import KAFKA_TEST_OPTIONS, ThreadedWorker, kafka_settings, kafka_url
from tests.kafka_broker import Broker
from tests.processes import launch, repo_env, worker_command
from tests.queue_checks import most_at_once, most_per_window, slot_spans

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

PARTITIONS = 4


async def test_limits_hold_across_two_workers_and_a_kill_9(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = kafka_settings(kafka_broker)
    create_topics(settings, PARTITIONS)
    procs: list[subprocess.Popen[bytes]] = []

    def worker(name: str) -> subprocess.Popen[bytes]:
        command = worker_command(
            "tests.queue_workflows",
            settings.bootstrap,
            settings.prefix,
            tmp_path / name,
            KAFKA_TEST_OPTIONS,
        )
        proc, _ = launch(command, env=repo_env(), log=tmp_path / f"{name}.log")
        procs.append(proc)
        return proc

    try:
        first, second = worker("w1"), worker("w2")
        async with Client.connect(kafka_url(settings)) as client:
            pooled = [f"p-{n}" for n in range(200)]
            paced = [f"r-{n}" for n in range(40)]
            for n, instance_id in enumerate(pooled):
                await client.start("pooled", 0.05, instance_id=instance_id)
                if n < len(paced):
                    await client.start("paced", None, instance_id=paced[n])
            # Slots are held on both workers: kill one, then the other, each replaced, so
            # whichever owned the queue's partition was killed while it admitted.
            for victim, done, successor in ((first, 20, "w3"), (second, 100, "w4")):
                for instance_id in pooled[:done]:
                    await client.result(instance_id, timeout=120)
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait(10)
                worker(successor)
            for instance_id in pooled:
                assert await client.result(instance_id, timeout=240) == 0.05, instance_id
            for instance_id in paced:
                assert await client.result(instance_id, timeout=240) == instance_id
            spans = [s for i in pooled for s in slot_spans(await client.history(i))]
            admitted = [a for i in paced for a, _ in slot_spans(await client.history(i))]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert len(spans) == 200 and len(admitted) == 40
    assert 1 < most_at_once(spans) <= 5
    assert most_per_window(admitted, 500) <= 10
    assert max(admitted) - min(admitted) >= 1500


async def test_a_withdrawal_lost_with_its_worker_is_published_by_the_next_owner(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    """The commit that records a holder's cancel reaches the history topic, and its
    worker dies before the withdrawal (a command to the queue) is produced. The next
    owner restores the cancel and publishes the withdrawal, so the waiter gets the slot."""
    settings = kafka_settings(kafka_broker)
    create_topics(settings, PARTITIONS)
    registry = Registry()
    registry.add_module("tests.queue_workflows")
    serde = default_serde()
    first = ThreadedWorker(settings, tmp_path / "w1", registry)
    second: ThreadedWorker | None = None
    cut: list[str] = []
    try:
        first.start(PARTITIONS)
        producer = first.worker._producer
        send = producer.send

        async def dies_after_the_history(records: list[OutRecord]) -> list[int]:
            cancels = [
                r
                for r in records
                if r.topic == f"{settings.prefix}.history"
                and isinstance(serde.decode(r.value), WorkflowCancelledRecord)
            ]
            if not cancels:
                return await send(records)
            history = [r for r in records if r.topic == f"{settings.prefix}.history"]
            await send(history)
            cut.extend(r.topic for r in records if r not in history)
            raise ConnectionError("killed after the history was acknowledged")

        producer.send = dies_after_the_history
        async with Client.connect(kafka_url(settings)) as client:
            await client.start("gate", None, instance_id="holder")
            await until_status(client, "holder", "running")
            await client.start("quick", None, instance_id="waiter")
            await until_status(client, "waiter", "pending")
            await client.cancel("holder", reason="done with it")
            for _ in range(500):
                if cut:
                    break
                await asyncio.sleep(0.02)
            assert cut == [f"{settings.prefix}.commands"], cut  # the withdrawal, lost
            await asyncio.to_thread(first.stop)
            second = ThreadedWorker(settings, tmp_path / "w2", registry)
            await asyncio.to_thread(second.start, PARTITIONS)
            assert (await client.status("holder")).status == "cancelled"
            assert await client.result("waiter", timeout=60) == "waiter"
    finally:
        await asyncio.to_thread(first.stop)
        if second is not None:
            await asyncio.to_thread(second.stop)


async def until_status(client: Client, instance_id: str, status: str) -> None:
    for _ in range(500):
        try:
            if (await client.status(instance_id)).status == status:
                return
        except UnknownInstance:
            pass
        await asyncio.sleep(0.02)
    raise AssertionError(f"{instance_id} never got {status}: {await client.status(instance_id)}")
