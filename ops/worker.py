"""``Worker``: runs workflows. ``embedded:PATH`` runs the embedded engine in this
process; ``kafka://HOST:PORT?prefix=P`` joins the Kafka consumer group of that prefix
(``ops.kafka_worker``) and serves the partitions the group gives it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.ops.embedded import EmbeddedConfig, EmbeddedEngine, open_embedded
from stepstream.producers.client import Client, Transport

if TYPE_CHECKING:
    from stepstream.ops.kafka_worker import KafkaWorker


class Worker:
    """Hosts partitions and runs the workflows registered with it::

    async with Worker([order], connect="embedded:./.stepstream") as worker:
        client = worker.client()
        await client.start("order", {...})

    With ``connect="kafka://HOST:PORT?prefix=P"`` the options are those of
    ``ops.kafka_worker.KafkaWorkerConfig`` (``state_dir``, ``host``, ``port``,
    ``advertise``, ``max_payload_bytes``, ``api``: an ``ops.api.security.ApiSecurity``)
    plus ``kafka`` (a dict of client properties), ``kafka_config`` (a properties file) and
    ``tls_ca`` (a CA file its client trusts for the workers' https APIs); ``start()``
    returns once the group has given this worker its first partitions.
    """

    def __init__(
        self,
        workflows: Iterable[object] = (),
        *,
        connect: str = "embedded:./.stepstream",
        modules: str | None = None,
        codec: PayloadCodec | None = None,
        **options: Any,
    ) -> None:
        self.registry = Registry(workflows)
        if modules:
            self.registry.add_modules(modules)
        self._connect = connect
        self._codec = codec
        self._options = options
        self._engine: EmbeddedEngine | None = None
        self._kafka: KafkaWorker | None = None
        self._kafka_client: Transport | None = None

    async def start(self) -> None:
        scheme, _, rest = self._connect.partition(":")
        if scheme == "kafka":
            await self._start_kafka()
            return
        if scheme != "embedded":
            raise StepstreamError(
                f"Worker cannot run on {self._connect!r}: use embedded:PATH or "
                "kafka://HOST:PORT?prefix=P"
            )
        config = EmbeddedConfig.from_env(data_dir=rest or None, **self._options)
        self._engine = await open_embedded(self.registry, config, codec=self._codec)

    async def _start_kafka(self) -> None:
        from stepstream.ops.kafka_worker import KafkaWorker
        from stepstream.ops.kafka_worker_config import KafkaWorkerConfig
        from stepstream.producers.http.security import TLS_CA_ENV
        from stepstream.producers.kafka import open_kafka_transport, settings_from_url

        options = dict(self._options)
        settings = settings_from_url(self._connect, options)
        tls_ca = options.pop("tls_ca", None) or os.environ.get(TLS_CA_ENV)
        config = KafkaWorkerConfig.from_env(settings, **options)
        worker = KafkaWorker(self.registry, config, codec=self._codec)
        await worker.start()
        self._kafka = worker
        await worker.wait_assigned()
        self._kafka_client = await open_kafka_transport(
            settings,
            codec=self._codec,
            max_payload_bytes=config.max_payload_bytes,
            token=config.api.token,
            tls_ca=tls_ca,
        )

    @property
    def engine(self) -> EmbeddedEngine:
        if self._engine is None:
            raise StepstreamError("the worker is not started; await worker.start() first")
        return self._engine

    @property
    def kafka(self) -> KafkaWorker:
        """The Kafka-mode worker (``connect="kafka://..."``)."""
        if self._kafka is None:
            raise StepstreamError("no Kafka worker is running; start one with kafka://...")
        return self._kafka

    def client(self) -> Client:
        """A client of this worker's engine: in-process (embedded), or a kafka:// client
        of the worker's prefix (it reaches every worker of the group)."""
        if self._kafka_client is not None:
            return Client(self._kafka_client)
        return Client(self.engine.transport)

    async def run(self) -> None:
        """Start (if needed) and run until cancelled."""
        if self._engine is None and self._kafka is None:
            await self.start()
        try:
            if self._kafka is not None:
                await self._kafka.run()
            else:
                await asyncio.Event().wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        if self._kafka_client is not None:
            await self._kafka_client.close()
            self._kafka_client = None
        if self._kafka is not None:
            await self._kafka.stop()
            self._kafka = None
        if self._engine is not None:
            await self._engine.close()
            self._engine = None

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
