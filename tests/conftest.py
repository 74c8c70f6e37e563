"""Shared fixtures: a client over each backend, with the test workflows registered.

The Kafka backend runs against one real broker per run: Apache Kafka (one KRaft node
from its Maven Central jars, over TCP, shared by every xdist worker; if it cannot start,
every Kafka test fails with the reason). Each Kafka test gets its own topic
prefix and its own worker, run in this process on a thread with its own event loop (so
step bodies see the test's environment), reached through a ``kafka://`` client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import settings as hypothesis_settings

import stepstream.producers.kafka  # noqa: F401  (registers kafka:// with Client.connect)
from stepstream.engine.api.workflow import Registry
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.replay.runtime import InstanceRuntime
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests.kafka_broker import Broker, discard, start_test_kafka
from tests.shared_kafka import shared_broker, stop_shared

# Property tests check behaviour, not speed: on a loaded machine (the suite runs three
# workers on two cores) one example may take longer than hypothesis's 200 ms deadline,
# which must not fail a test about what the code does.
hypothesis_settings.register_profile("stepstream", deadline=None)
hypothesis_settings.load_profile("stepstream")

T = TypeVar("T")

# A worker that dies is noticed by the group coordinator after session.timeout.ms.
KAFKA_TEST_OPTIONS = ("session.timeout.ms=2000", "heartbeat.interval.ms=300")
KAFKA_TEST_PARTITIONS = 2


def test_registry() -> Registry:
    registry = Registry()
    registry.add_module("tests.workflows")
    registry.add_module("tests.lifecycle_workflows")
    return registry


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "ledger"
    root.mkdir()
    monkeypatch.setenv("STEPSTREAM_TEST_LEDGER", str(root))
    return root


@pytest.fixture(scope="session")
def kafka_broker(worker_id: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    # Raises with the reason and the broker's log: never a skip.
    if worker_id != "master":  # under xdist: one broker for the whole run (tests.shared_kafka)
        yield shared_broker(tmp_path_factory.getbasetemp().parent)
        return
    broker = start_test_kafka()
    yield broker
    discard(broker)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):
        return  # a worker: the broker outlives it, the controller stops it
    factory: pytest.TempPathFactory | None = getattr(session.config, "_tmp_path_factory", None)
    # Only a run whose base temporary directory exists can have started one (asking for
    # it would make a new one).
    if factory is not None and factory._basetemp is not None:
        stop_shared(factory._basetemp)


def kafka_settings(broker: Broker, prefix: str | None = None) -> KafkaSettings:
    return KafkaSettings.load(
        broker.bootstrap,
        prefix or f"t{uuid.uuid4().hex[:10]}",
        options=KAFKA_TEST_OPTIONS,
        environ={},
    )


class ThreadedWorker:
    """A ``KafkaWorker`` on its own thread and event loop, driven from a test's loop."""

    def __init__(
        self,
        settings: KafkaSettings,
        state_dir: Path,
        registry: Registry,
        sources: Any = None,
        **config: Any,
    ) -> None:
        from stepstream.ops.kafka_worker import KafkaWorker
        from stepstream.ops.kafka_worker_config import KafkaWorkerConfig

        self.settings = settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="test-kafka-worker", daemon=True
        )
        self._thread.start()
        built = KafkaWorkerConfig(settings, state_dir=str(state_dir), port=0, **config)
        self.worker: Any = self.call_sync(_build(KafkaWorker, registry, built, sources=sources))

    def call_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=120)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return await asyncio.wrap_future(future)

    def start(self, partitions: int | None = KAFKA_TEST_PARTITIONS) -> None:
        """Blocks until the worker owns ``partitions`` (None: its first assignment)."""
        self.call_sync(self.worker.start())
        self.call_sync(self.worker.wait_assigned(partitions, timeout=60))

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self.call_sync(self.worker.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


async def _build(cls: Any, *args: Any, **kwargs: Any) -> Any:
    return cls(*args, **kwargs)  # constructed on the worker's loop: it creates asyncio primitives


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many times each instance's code began again from its stored state."""
    counts: Counter[str] = Counter()
    begin = InstanceRuntime._begin

    def counting(runtime: InstanceRuntime) -> None:
        if runtime.state.entries:
            counts[runtime.state.instance_id] += 1
        begin(runtime)

    monkeypatch.setattr(InstanceRuntime, "_begin", counting)
    return counts


@pytest.fixture
def kafka_worker(kafka_broker: Broker, tmp_path: Path) -> Iterator[ThreadedWorker]:
    """A fresh prefix (topics created) and a worker that owns all of its partitions."""
    from stepstream.consumers.kafka import create_topics

    settings = kafka_settings(kafka_broker)
    create_topics(settings, KAFKA_TEST_PARTITIONS)
    worker = ThreadedWorker(settings, tmp_path / "worker", test_registry())
    try:
        worker.start()
        yield worker
    finally:
        worker.stop()


def kafka_url(settings: KafkaSettings) -> str:
    return f"kafka://{settings.bootstrap}?prefix={settings.prefix}"


@pytest.fixture(params=["embedded", "kafka"])
async def client(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Client]:
    if request.param == "kafka":
        worker: ThreadedWorker = request.getfixturevalue("kafka_worker")
        async with Client.connect(kafka_url(worker.settings)) as c:
            yield c
        return
    engine = await open_embedded(
        test_registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    )
    async with Client(engine.make_transport(owns_engine=True)) as c:
        yield c
