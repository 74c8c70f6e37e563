"""The web UI's view of a Kafka deployment from one of its workers.

A worker owns some partitions; its UI lists and controls every instance, so it reads
through a ``kafka://`` client of its own cluster (``producers.kafka``), the way any
client does: it finds the other workers on the members topic and asks each for its
partitions. The client is opened on the UI's first request, not at start, so a worker
whose UI nobody opens pays nothing for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.producers.client import Transport
from stepstream.producers.http.security import TLS_CA_ENV
from stepstream.producers.kafka import open_kafka_transport


class ClusterView:
    """``await transport()`` for the UI; ``await close()`` when the worker stops."""

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        token: str | None,
        codec: PayloadCodec,
        max_payload_bytes: int,
    ) -> None:
        self._settings = settings
        self._token = token
        self._codec = codec
        self._max_payload_bytes = max_payload_bytes
        self._opening: asyncio.Task[Transport] | None = None

    async def transport(self) -> Transport:
        if self._opening is None or (self._opening.done() and self._opening.exception()):
            # Opened once for every request that waits for it; a failure is tried again
            # by the next request (the error reaches this one's caller).
            self._opening = asyncio.ensure_future(self._open())
        return await asyncio.shield(self._opening)

    async def _open(self) -> Transport:
        return await open_kafka_transport(
            self._settings,
            codec=self._codec,
            max_payload_bytes=self._max_payload_bytes,
            token=self._token,
            tls_ca=os.environ.get(TLS_CA_ENV) or None,
        )

    async def close(self) -> None:
        opening, self._opening = self._opening, None
        if opening is None:
            return
        if not opening.done():
            opening.cancel()
        with contextlib.suppress(BaseException):
            await (await opening).close()
