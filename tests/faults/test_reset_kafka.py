"""A reset applied while the instance's partition changes owner on Kafka: `stepstream
reset` is sent, the worker that owns the partition is killed with -9 at once and a third
worker joins, so the reset is applied by whichever worker owns the partition by then (or
by the killed one and restored by the next); then a worker with no state of its own
restores every partition from the topics. Every instance must end with one reset in
its history, the records after the key kept and marked set aside, the steps before the
key run once ever (their side effects are counted in files), and the right result."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest

from stepstream import Client, ConnectionFailed, WorkflowFailed
from stepstream.consumers.kafka import create_topics
from tests.conftest import KAFKA_TEST_OPTIONS, kafka_settings, kafka_url
from tests.kafka_broker import Broker
from tests.processes import launch, repo_env, worker_command
from tests.workflows import ledger_count

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

PARTITIONS = 4
INSTANCES = 8


async def test_a_reset_across_a_kill_9_and_a_join_keeps_the_history_and_goes_on(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = kafka_settings(kafka_broker)
    create_topics(settings, PARTITIONS)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    env = repo_env(STEPSTREAM_TEST_LEDGER=str(ledger))
    procs: list[subprocess.Popen[bytes]] = []

    def worker(name: str) -> subprocess.Popen[bytes]:
        command = worker_command(
            "tests.workflows",
            settings.bootstrap,
            settings.prefix,
            tmp_path / name,
            KAFKA_TEST_OPTIONS,
        )
        proc, _ = launch(command, env=env, log=tmp_path / f"{name}.log")
        procs.append(proc)
        return proc

    ids = [f"rk-{n}" for n in range(INSTANCES)]
    try:
        first = worker("w1")
        worker("w2")
        async with Client.connect(kafka_url(settings)) as client:
            for instance in ids:
                await client.start("repairable", {}, instance_id=instance)
                await client.send_event(instance, "go", {"by": "ada"})
            for instance in ids:  # the warehouse is closed: "ship" fails for good
                with pytest.raises(WorkflowFailed):
                    await client.result(instance, timeout=120)
                (ledger / f"open-{instance}").touch()
            for instance in ids:
                await client.reset(instance, to="charge#2", reason="charge again")
            # Durable once reset() returned; its partition changes owner now, twice.
            os.kill(first.pid, signal.SIGKILL)
            first.wait(10)
            worker("w3")
            for instance in ids:
                result = await client.result(instance, timeout=180)
                assert result["ship"] == "shipped", instance
                assert result["charges"] == ["charged charge", "charged charge#2"], instance
                history = await client.history(instance)
                types = [h.type for h in history]
                assert types.count("WorkflowReset") == 1, history
                reset = next(h for h in history if h.type == "WorkflowReset")
                aside = [h for h in history if h.set_aside]
                # From charge#2's first record to the reset: kept, marked set aside.
                assert aside and all(h.seq < reset.seq for h in aside), history
                assert {"StepSucceeded", "WorkflowFailed"} <= {h.type for h in aside}, history
                assert not any(h.set_aside for h in history if h.seq > reset.seq), history
                # Before the key: run once, ever. From it on: again after the reset (a
                # kill -9 during an attempt may run it once more: at least once).
                assert ledger_count(ledger, f"{instance}-charge") == 1, instance
                assert ledger_count(ledger, f"{instance}-charge#2") in (2, 3), instance
                assert ledger_count(ledger, f"{instance}-ship") in (2, 3), instance
            seen = {i: await client.history(i) for i in ids}
            # A worker with no state of its own restores every partition from the topics,
            # resets and all, and reads the same.
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
            worker("w4")
            for instance in ids:
                assert await settled_status(client, instance) == "completed", instance
                assert await client.history(instance) == seen[instance], instance
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


async def settled_status(client: Client, instance: str) -> str:
    """The status once a live worker owns the instance's partition."""
    for _ in range(300):
        try:
            return (await client.status(instance)).status
        except ConnectionFailed:
            await asyncio.sleep(0.1)
    return (await client.status(instance)).status
