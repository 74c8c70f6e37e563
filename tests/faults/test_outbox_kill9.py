"""The outbox across kill -9: a consumer that drops duplicate ``stepstream-id``s sees
each ``ctx.publish`` exactly once, and none is missing.

A `stepstream worker` (Kafka, restarted on the same state directory) and a `stepstream
dev` (embedded, ``STEPSTREAM_OUTBOX_BOOTSTRAP``, restarted on the same data directory)
run ``outbox-many`` of ``tests.outbox_workflows``: N publishes, each followed by a step.
The process kills itself with SIGKILL at one point per run (``STEPSTREAM_TEST_OUTBOX_KILL``):
before the produce of record 1 (its attempt durable), after the broker acknowledged
record 3 (its outcome not yet committed), and after the outcome of record 4 is
committed; a last run completes. The topic then holds exactly one copy of each record
but record 3, which has two with one id.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from stepstream import UnknownWorkflow
from stepstream.consumers.kafka import create_topics
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.producers.client import Client
from tests.conftest import KAFKA_TEST_OPTIONS, KAFKA_TEST_PARTITIONS, kafka_settings, kafka_url
from tests.dev_server import clean_env
from tests.integration.test_outbox import create_topic, first_of_each_id, read_topic
from tests.kafka_broker import Broker
from tests.outbox_workflows import KILL_ENV, NOTES_ENV
from tests.processes import launch

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

REPO = Path(__file__).resolve().parents[2]
N = 6
KILLS = [("before-produce", 1), ("after-ack", 3), ("after-commit", 4)]


class Process:
    """`stepstream worker` or `stepstream dev` on the same state, started again and again."""

    def __init__(self, backend: str, broker: Broker, root: Path) -> None:
        self.backend = backend
        self.root = root
        self.log = root / "process.log"
        self.notes = root / "notes"
        self.notes.mkdir()
        self.settings: KafkaSettings = kafka_settings(broker)
        self.bootstrap = broker.bootstrap
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def command(self) -> list[str]:
        base = [sys.executable, "-m", "stepstream.ops.cli"]
        common = ["--workflows", "tests.outbox_workflows", "--port", "0"]
        if self.backend == "dev":
            return [*base, "dev", *common, "--data", str(self.root / "data"), "--partitions", "2"]
        args = [*base, "worker", *common, "--state-dir", str(self.root / "state")]
        args += ["--bootstrap", self.settings.bootstrap, "--prefix", self.settings.prefix]
        for option in KAFKA_TEST_OPTIONS:
            args += ["--kafka-opt", option]
        return args

    def start(self, kill: str | None) -> None:
        env = clean_env(REPO, **{NOTES_ENV: str(self.notes)})
        env.pop(KILL_ENV, None)
        env.pop("STEPSTREAM_OUTBOX_BOOTSTRAP", None)  # a worker publishes to its own cluster
        if kill is not None:
            env[KILL_ENV] = kill
        if self.backend == "dev":
            env["STEPSTREAM_OUTBOX_BOOTSTRAP"] = self.bootstrap
        self.proc, url = launch(
            self.command(),
            env=env,
            log=self.log,
            what=self.backend,
            header=f"---- start, kill at {kill} ----\n",
        )
        self.url = url if self.backend == "dev" else kafka_url(self.settings)

    async def died_at(self, point: str, index: int) -> None:
        assert self.proc is not None
        try:
            code = await asyncio.to_thread(self.proc.wait, 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"not killed at {point} {index}:\n{self.log.read_text()[-4000:]}")
        killed = (self.notes / "killed").read_text().split()
        assert (code, killed) == (-9, [point, str(index)]), self.log.read_text()[-4000:]
        (self.notes / "killed").unlink()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # by pid: the processes this test started, nothing else
            self.proc.wait(10)


async def _start(client: Client, topic: str) -> str:
    """Start once the worker's workflows are known (it listens before it registers)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await client.start("outbox-many", {"n": N, "topic": topic}, instance_id="m-1")
        except UnknownWorkflow:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("backend", ["worker", "dev"])
async def test_each_publish_is_seen_once_by_a_consumer_dropping_duplicate_ids(
    backend: str, kafka_broker: Broker, tmp_path: Path
) -> None:
    process = Process(backend, kafka_broker, tmp_path)
    topic = f"many-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(create_topic, kafka_broker.bootstrap, topic)
    if backend == "worker":
        await asyncio.to_thread(create_topics, process.settings, KAFKA_TEST_PARTITIONS)
    try:
        for run, (point, index) in enumerate(KILLS):
            process.start(f"{point}:{index}")
            if run == 0:
                async with Client.connect(process.url) as client:
                    await _start(client, topic)
            await process.died_at(point, index)
        process.start(None)
        async with Client.connect(process.url) as client:
            assert await client.result("m-1", timeout=90) == N
            history = await client.history("m-1")
    finally:
        process.stop()

    records = await asyncio.to_thread(read_topic, kafka_broker.bootstrap, topic)
    kept = first_of_each_id(records)
    keys = [f"publish:{topic}"] + [f"publish:{topic}#{n}" for n in range(2, N + 1)]
    assert sorted(kept) == sorted(f"m-1/{key}" for key in keys), records
    assert {json.loads(kept[f"m-1/{key}"].value)["i"] for key in keys} == set(range(N))
    copies = Counter(json.loads(r.value)["i"] for r in records)
    # Only the record acknowledged just before a kill went out twice (same id, same value).
    assert copies == Counter({**dict.fromkeys(range(N), 1), 3: 2}), records
    succeeded = Counter(h.attributes["key"] for h in history if h.type == "StepSucceeded")
    assert all(succeeded[key] == 1 for key in keys), history
    lost = [
        (h.attributes["key"], h.attributes["attempt"])
        for h in history
        if h.type == "StepFailed" and h.attributes["error_type"] == "AttemptLost"
    ]
    # The attempts the kills cut short were retried: two publishes and one step after.
    assert lost == [(keys[1], 1), (keys[3], 1), ("after#5", 1)], history
