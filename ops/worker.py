"""``Worker``: runs workflows. Embedded today (``embedded:PATH``); the same class runs a
Kafka consumer group when given ``kafka://`` (see the Kafka backend)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from engine.codec import PayloadCodec
from engine.errors import StepstreamError
from engine.workflow import Registry
from ops.embedded import EmbeddedConfig, EmbeddedEngine, open_embedded
from producers.client import Client


class Worker:
    """Hosts partitions and runs the workflows registered with it::

    async with Worker([order], connect="embedded:./.stepstream") as worker:
        client = worker.client()
        await client.start("order", {...})
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

    async def start(self) -> None:
        scheme, _, rest = self._connect.partition(":")
        if scheme != "embedded":
            raise StepstreamError(
                f"Worker cannot run on {self._connect!r} yet: only embedded:PATH is available "
                "in this build"
            )
        config = EmbeddedConfig.from_env(data_dir=rest or None, **self._options)
        self._engine = await open_embedded(self.registry, config, codec=self._codec)

    @property
    def engine(self) -> EmbeddedEngine:
        if self._engine is None:
            raise StepstreamError("the worker is not started; await worker.start() first")
        return self._engine

    def client(self) -> Client:
        """A client that talks to this worker in-process."""
        return Client(self.engine.transport)

    async def run(self) -> None:
        """Start (if needed) and run until cancelled."""
        if self._engine is None:
            await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        if self._engine is not None:
            await self._engine.close()
            self._engine = None

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
