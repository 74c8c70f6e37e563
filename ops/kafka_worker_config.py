"""How a ``stepstream worker`` is configured: ``KafkaWorkerConfig``, from the CLI's flags
and the ``STEPSTREAM_*`` variables (``from_env``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from stepstream.consumers.kafka.snapshots import DEFAULT_SNAPSHOT_EVERY
from stepstream.consumers.partition import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_RETENTION_S,
    ProcessorConfig,
)
from stepstream.consumers.rocks_memory import RocksMemory
from stepstream.consumers.sources import SourcesConfig
from stepstream.consumers.spans import SpanSink
from stepstream.engine.api.outbox import ENV_BOOTSTRAP as OUTBOX_ENV
from stepstream.engine.config.environ import env_int, env_seconds
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.wire.codec import DEFAULT_MAX_PAYLOAD_BYTES
from stepstream.ops.api.limits import ApiLimits
from stepstream.ops.api.security import ApiSecurity

DEFAULT_STATE_DIR = "./.stepstream-worker"
DEFAULT_PORT = 8233
ENV_EXIT_AFTER_LOGIN_REFUSED = "STEPSTREAM_EXIT_AFTER_LOGIN_REFUSED_S"


@dataclass(frozen=True)
class KafkaWorkerConfig:
    settings: KafkaSettings
    state_dir: str = DEFAULT_STATE_DIR
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # The URL clients reach this worker's API at (default: http://host:port as bound).
    advertise: str | None = None
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    # The processors' settings, the instance cache's size among them.
    processor: ProcessorConfig = field(default_factory=ProcessorConfig)
    # History records between snapshots of a partition's state (0: no snapshots).
    snapshot_every: int = DEFAULT_SNAPSHOT_EVERY
    # Who may use the API: token, allowed hosts, TLS (STEPSTREAM_API_TOKEN and so on).
    api: ApiSecurity = field(default_factory=ApiSecurity)
    # What the API holds at once over all its clients (STEPSTREAM_MAX_PENDING).
    api_limits: ApiLimits = field(default_factory=ApiLimits)
    # Where spans of runs and step attempts go (None: no tracing; the CLI builds one
    # from the OTEL_* variables).
    tracer_provider: TracerProvider | None = None
    # Or a sink for them (the CLI's: a process that makes and exports the spans).
    span_sink: SpanSink | None = None
    # How the user topics declared as Source are read (STEPSTREAM_SOURCES_*).
    sources: SourcesConfig = field(default_factory=SourcesConfig)
    # The cluster ctx.publish produces to (STEPSTREAM_OUTBOX_BOOTSTRAP, with the same
    # client properties); None: the worker's own.
    outbox_bootstrap: str | None = None
    # Exit (fail) once Kafka has refused the worker's login for this long, so that a
    # supervisor starts it again with the credentials it has now (0: wait for ever, and
    # go on when Kafka accepts the login again). STEPSTREAM_EXIT_AFTER_LOGIN_REFUSED_S.
    exit_after_login_refused_s: float = 0.0
    # What the partitions' RocksDB databases may hold in memory together
    # (STEPSTREAM_ROCKSDB_MEMORY_MB).
    rocksdb_memory: RocksMemory = field(default_factory=RocksMemory)

    @classmethod
    def from_env(cls, settings: KafkaSettings, **overrides: Any) -> KafkaWorkerConfig:
        env = os.environ
        values: dict[str, Any] = {
            "state_dir": env.get("STEPSTREAM_STATE_DIR", DEFAULT_STATE_DIR),
            "max_payload_bytes": env_int(
                env, "STEPSTREAM_MAX_PAYLOAD_BYTES", DEFAULT_MAX_PAYLOAD_BYTES
            ),
        }
        values["processor"] = ProcessorConfig(
            drain_timeout_s=env_seconds(env, "STEPSTREAM_DRAIN_TIMEOUT_S", DEFAULT_DRAIN_TIMEOUT_S),
            retention_s=env_seconds(env, "STEPSTREAM_RETENTION_S", DEFAULT_RETENTION_S),
        )
        values["snapshot_every"] = env_int(
            env, "STEPSTREAM_SNAPSHOT_EVERY", DEFAULT_SNAPSHOT_EVERY, minimum=0
        )
        if "STEPSTREAM_ADVERTISE" in env:
            values["advertise"] = env["STEPSTREAM_ADVERTISE"]
        values["api"] = ApiSecurity.from_env(env)
        values["api_limits"] = ApiLimits.from_env(env)
        values["sources"] = SourcesConfig.from_env(env)
        values["outbox_bootstrap"] = env.get(OUTBOX_ENV) or None
        values["exit_after_login_refused_s"] = env_seconds(env, ENV_EXIT_AFTER_LOGIN_REFUSED, 0.0)
        values["rocksdb_memory"] = RocksMemory.from_env(env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(settings, **values)
