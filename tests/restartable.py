"""A backend a test can restart: an embedded engine reopened on its data directory, or a
Kafka worker replaced by a new one on the same state directory (the client stays)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from stepstream.engine.api.workflow import Registry
from stepstream.ops.embedded import EmbeddedConfig, EmbeddedEngine, open_embedded
from stepstream.producers.client import Client
from tests.conftest import KAFKA_TEST_PARTITIONS, ThreadedWorker, kafka_settings, kafka_url
from tests.kafka_broker import Broker


class RestartableEmbedded:
    def __init__(self, data_dir: Path, registry: Callable[[], Registry]) -> None:
        self._config = EmbeddedConfig(data_dir=str(data_dir), partitions=2)
        self._registry = registry
        self._engine: EmbeddedEngine | None = None
        self.client: Client | None = None

    async def open(self) -> Client:
        self._engine = await open_embedded(self._registry(), self._config)
        self.client = Client(self._engine.make_transport())
        return self.client

    async def restart(self) -> Client:
        await self.close()
        return await self.open()

    async def close(self) -> None:
        if self._engine is not None:
            await self._engine.close()
            self._engine = None


class RestartableKafka:
    def __init__(self, broker: Broker, state_dir: Path, registry: Callable[[], Registry]) -> None:
        self._settings = kafka_settings(broker)
        self._state_dir = state_dir
        self._registry = registry
        self._worker: ThreadedWorker | None = None
        self.client: Client | None = None

    async def open(self) -> Client:
        from stepstream.consumers.kafka import create_topics

        await asyncio.to_thread(create_topics, self._settings, KAFKA_TEST_PARTITIONS)
        await self._start_worker()
        self.client = await Client.connect(kafka_url(self._settings))
        return self.client

    async def _start_worker(self) -> None:
        self._worker = ThreadedWorker(self._settings, self._state_dir, self._registry())
        await asyncio.to_thread(self._worker.start)

    async def restart(self) -> Client:
        """A new worker on the same state directory; the client stays."""
        assert self._worker is not None and self.client is not None
        await asyncio.to_thread(self._worker.stop)
        self._worker = None
        await self._start_worker()
        return self.client

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self._worker is not None:
            await asyncio.to_thread(self._worker.stop)


@contextlib.asynccontextmanager
async def restartable_backend(
    request: pytest.FixtureRequest, tmp_path: Path, registry: Callable[[], Registry]
) -> AsyncIterator[RestartableEmbedded | RestartableKafka]:
    """The backend ``request.param`` names ("embedded" or "kafka"), opened, then closed."""
    made: RestartableEmbedded | RestartableKafka
    if request.param == "kafka":
        made = RestartableKafka(
            request.getfixturevalue("kafka_broker"), tmp_path / "worker", registry
        )
    else:
        made = RestartableEmbedded(tmp_path / "data", registry)
    try:
        await made.open()
        yield made
    finally:
        await made.close()
