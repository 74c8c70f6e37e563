"""The embedded engine: one process, one data directory, nothing else to install.

Assembles the embedded backend's partitions, the partition host (processors, timers,
step executor) and an in-process client transport, and registers ``embedded:PATH`` with
``Client.connect``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stepstream.consumers.embedded.db import EmbeddedDB
from stepstream.consumers.embedded.partition import EmbeddedPartition
from stepstream.consumers.host import PartitionHost
from stepstream.consumers.partition import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_RETENTION_S,
    SWEEP_INTERVAL_S,
    ProcessorConfig,
)
from stepstream.consumers.rocks_memory import RocksMemory
from stepstream.engine.api.outbox import ENV_BOOTSTRAP as OUTBOX_ENV
from stepstream.engine.api.outbox import Outbox
from stepstream.engine.api.workflow import Registry
from stepstream.engine.config.environ import env_int, env_seconds
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.errors import StepstreamError
from stepstream.engine.seams import Append, Clock, SystemClock
from stepstream.engine.wire.codec import DEFAULT_MAX_PAYLOAD_BYTES, JsonCodec, PayloadCodec
from stepstream.engine.wire.records import Command
from stepstream.engine.wire.serde import RecordSerde, default_serde
from stepstream.engine.wire.topics import COMMANDS
from stepstream.producers.client import Transport, register_transport
from stepstream.producers.publisher import LogTransport

if TYPE_CHECKING:
    from stepstream.consumers.kafka.outbox import KafkaOutbox

DEFAULT_DATA_DIR = "./.stepstream"
# Written in a data directory whose partitions several processes share (ops/processes/).
PROCESSES_FILE = "processes.json"


@dataclass(frozen=True)
class EmbeddedConfig:
    data_dir: str = DEFAULT_DATA_DIR
    partitions: int | None = None
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    cache_size: int = 10_000
    # On close: how long running step attempts may take to finish and be recorded.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # How long finished instances stay readable (0: for ever).
    retention_s: float = DEFAULT_RETENTION_S
    sweep_interval_s: float = SWEEP_INTERVAL_S  # how often expired instances are looked for
    # The Kafka cluster ctx.publish produces to (STEPSTREAM_OUTBOX_BOOTSTRAP, HOST:PORT;
    # client properties from STEPSTREAM_KAFKA_*); None: publishing fails, saying so.
    outbox_bootstrap: str | None = None
    # What the data directory's RocksDB may hold in memory (STEPSTREAM_ROCKSDB_MEMORY_MB).
    rocksdb_memory: RocksMemory = field(default_factory=RocksMemory)

    @classmethod
    def from_env(cls, **overrides: Any) -> EmbeddedConfig:
        env = os.environ
        values: dict[str, Any] = {
            "data_dir": env.get("STEPSTREAM_DATA", DEFAULT_DATA_DIR),
            "max_payload_bytes": env_int(
                env, "STEPSTREAM_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES
            ),
        }
        values["drain_timeout_s"] = env_seconds(
            env, "STEPSTREAM_DRAIN_TIMEOUT_S", DEFAULT_DRAIN_TIMEOUT_S
        )
        values["retention_s"] = env_seconds(env, "STEPSTREAM_RETENTION_S", DEFAULT_RETENTION_S)
        values["outbox_bootstrap"] = env.get(OUTBOX_ENV) or None
        values["rocksdb_memory"] = RocksMemory.from_env(env)
        if "STEPSTREAM_PARTITIONS" in env:
            values["partitions"] = env_int(env, "STEPSTREAM_PARTITIONS", 4)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


class EmbeddedEngine:
    def __init__(
        self,
        db: EmbeddedDB,
        host: PartitionHost,
        serde: RecordSerde,
        codec: PayloadCodec,
        config: EmbeddedConfig,
        outbox: KafkaOutbox | None = None,
    ) -> None:
        self.db = db
        self._outbox = outbox
        self.host = host
        self._serde = serde
        self._codec = codec
        self._config = config
        self.transport = self.make_transport()
        self._closed = False

    @property
    def codec(self) -> PayloadCodec:
        return self._codec

    @property
    def max_payload_bytes(self) -> int:
        return self._config.max_payload_bytes

    def make_transport(self, *, owns_engine: bool = False) -> LogTransport:
        """An in-process transport; with ``owns_engine`` closing it closes the engine."""
        return LogTransport(
            self.publish,
            self.host,
            codec=self._codec,
            max_payload_bytes=self._config.max_payload_bytes,
            on_close=self.close if owns_engine else None,
            clock=self.host.clock,
        )

    async def publish(self, command: Command) -> None:
        await self.db.log.append(
            [Append(COMMANDS, command.instance_id.encode(), self._serde.encode(command))]
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.db.failure is not None:
            # Nothing more can be recorded: running attempts are not waited for.
            for partition in self.host.owned:
                await self.host.revoke(partition)
        await self.host.close()
        if self._outbox is not None:
            await asyncio.to_thread(self._outbox.close)
        await self.db.close()


def _refuse_split(data_dir: str) -> None:
    """A directory of several engine processes' shares is not one engine's."""
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise StepstreamError(
            f"{data_dir} is a file, not a data directory: give --data a directory (one that "
            "does not exist yet is made)"
        )
    path = os.path.join(data_dir, PROCESSES_FILE)
    try:
        with open(path) as f:
            count = json.load(f)["processes"]
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StepstreamError(
            f"cannot read {path} ({exc}); it says how many engine processes share this "
            "data directory: put it back, or give --data another directory"
        ) from None
    raise StepstreamError(
        f"data directory {data_dir} holds partitions spread over {count} engine processes: "
        f"serve it with `stepstream dev --processes {count}`"
    )


def _outbox(bootstrap: str | None) -> KafkaOutbox | None:
    if not bootstrap:
        return None
    # Imported here: an engine that publishes nowhere never loads the Kafka client.
    from stepstream.consumers.kafka.outbox import KafkaOutbox

    return KafkaOutbox(KafkaSettings.load(bootstrap), client_id="stepstream-embedded-outbox")


async def open_embedded(
    registry: Registry,
    config: EmbeddedConfig | None = None,
    *,
    codec: PayloadCodec | None = None,
    clock: Clock | None = None,
    outbox: Outbox | None = None,
    owned: Callable[[int], bool] | None = None,
) -> EmbeddedEngine:
    """``outbox``: what ``ctx.publish`` produces with, instead of the Kafka cluster of
    ``config.outbox_bootstrap``. ``owned``: which partitions this process runs (all by
    default; one of several engine processes runs its share, ``ops/processes/``)."""
    config = config or EmbeddedConfig()
    if owned is None:
        _refuse_split(config.data_dir)
    codec = codec or JsonCodec()
    serde = default_serde()
    db = await EmbeddedDB.open(config.data_dir, config.partitions, memory=config.rocksdb_memory)
    kafka_outbox = None if outbox is not None else _outbox(config.outbox_bootstrap)
    host = PartitionHost(
        registry,
        partitions=db.partitions,
        serde=serde,
        codec=codec,
        clock=clock or SystemClock(),
        max_payload_bytes=config.max_payload_bytes,
        config=ProcessorConfig(
            cache_size=config.cache_size,
            drain_timeout_s=config.drain_timeout_s,
            retention_s=config.retention_s,
            sweep_interval_s=config.sweep_interval_s,
        ),
        outbox=outbox or kafka_outbox,
    )
    try:
        for partition in range(db.partitions):
            if owned is None or owned(partition):
                await host.assign(EmbeddedPartition(db, partition))
    except BaseException:
        await host.close()
        await db.close()
        raise
    return EmbeddedEngine(db, host, serde, codec, config, kafka_outbox)


async def _connect(url: str, options: dict[str, Any]) -> Transport:
    path = url.split(":", 1)[1] or DEFAULT_DATA_DIR
    registry = Registry(options.pop("workflows", ()))
    modules = options.pop("modules", None) or os.environ.get("STEPSTREAM_WORKFLOWS")
    if modules:
        registry.add_modules(modules)
    codec = options.pop("codec", None)
    config = EmbeddedConfig.from_env(data_dir=path, **options)
    engine = await open_embedded(registry, config, codec=codec)
    return engine.make_transport(owns_engine=True)


register_transport("embedded", _connect)
