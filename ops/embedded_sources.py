"""Event sources on ``stepstream dev``: when ``STEPSTREAM_SOURCES_BOOTSTRAP`` names a
Kafka cluster, the topics that the loaded workflow modules declare as ``Source`` are
read there (consumer group ``<prefix>.sources``, the prefix from ``STEPSTREAM_PREFIX``,
client properties from ``STEPSTREAM_KAFKA_*``) and their commands and dead letters are
appended to the embedded log, offsets committed once the append is durable."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from stepstream.consumers.sources import SourceConsumer, SourcesConfig
from stepstream.engine.api.sources import declared_sources
from stepstream.engine.api.workflow import Registry
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.seams import SystemClock
from stepstream.engine.wire.serde import default_serde
from stepstream.ops.embedded import EmbeddedEngine

log = logging.getLogger("stepstream.sources")

ENV_BOOTSTRAP = "STEPSTREAM_SOURCES_BOOTSTRAP"


async def start_embedded_sources(
    registry: Registry, engine: EmbeddedEngine, environ: Mapping[str, str] | None = None
) -> SourceConsumer | None:
    """The running sources consumer, or None when no module declares a source or no
    cluster is named (then the sources are listed in the log, unread)."""
    env = os.environ if environ is None else environ
    sources = declared_sources(registry)
    if not sources:
        return None
    bootstrap = env.get(ENV_BOOTSTRAP)
    if not bootstrap:
        log.warning(
            "not reading the source topics %s: set %s=HOST:PORT to read them from Kafka",
            ", ".join(s.topic for s in sources),
            ENV_BOOTSTRAP,
        )
        return None
    consumer = SourceConsumer(
        KafkaSettings.load(bootstrap, environ=env),
        sources,
        sink=engine.db.log.append,
        serde=default_serde(),
        codec=engine.codec,
        clock=SystemClock(),
        max_payload_bytes=engine.max_payload_bytes,
        config=SourcesConfig.from_env(env),
    )
    await consumer.start()
    return consumer
