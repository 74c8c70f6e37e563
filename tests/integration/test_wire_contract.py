"""Commands from any language: docs/wire-contract.md, followed by a producer that uses
only confluent-kafka, fastavro and the ``.avsc`` files (``examples/wire_producer.py``, no
stepstream import), runs on a worker."""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path

from examples.wire_producer import CommandProducer
from stepstream.producers.client import Client
from tests.conftest import ThreadedWorker, kafka_url
from tests.integration.test_kafka_backend import instance_on, read_topic

REPO = Path(__file__).resolve().parents[2]


def test_the_producer_imports_nothing_of_stepstream() -> None:
    tree = ast.parse((REPO / "examples" / "wire_producer.py").read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported - set(sys.stdlib_module_names) == {"confluent_kafka", "fastavro"}


async def test_start_and_send_produced_without_stepstream_run_on_a_worker(
    kafka_worker: ThreadedWorker,
) -> None:
    settings = kafka_worker.settings
    producer = CommandProducer(settings.bootstrap, settings.prefix)
    # One instance on each partition: murmur2 must put them where the worker expects
    # them, or they would be dead-lettered as misrouted.
    instances = [instance_on(0, "wire"), instance_on(1, "wire")]
    for instance in instances:
        await asyncio.to_thread(producer.start, "gated", instance, instance)
        for _ in range(2):  # a retried send, with the same event id
            await asyncio.to_thread(producer.send, instance, "go", {"n": 1}, f"go-{instance}")

    async with Client.connect(kafka_url(settings)) as client:
        for instance in instances:
            result = await client.result(instance, timeout=30)
            assert result == [f"{instance}-before", "{'n': 1}", f"{instance}-after"]
            history = await client.history(instance)
            # Applied once: a duplicate would be buffered again after the wait took one.
            buffered = [h.command_id for h in history if h.type == "EventBuffered"]
            taken = [h.attributes["event_command_id"] for h in history if h.type == "WaitSatisfied"]
            assert buffered in ([], [f"go-{instance}"]), history
            assert taken == [f"go-{instance}"], history
    assert await asyncio.to_thread(read_topic, settings, "dead-letters") == []
