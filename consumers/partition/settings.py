"""The partition processor's settings, and what one commit tells the waiters."""

from __future__ import annotations

from dataclasses import dataclass, field

from stepstream.engine.replay.state import InstanceState
from stepstream.engine.wire.codec import DEFAULT_MAX_PAYLOAD_BYTES
from stepstream.engine.wire.records import Payload

RESTART_BACKOFF_S = 0.1
MAX_RESTART_BACKOFF_S = 30.0
DEFAULT_DRAIN_TIMEOUT_S = 10.0
DEFAULT_RETENTION_S = 30 * 24 * 3600.0
SWEEP_INTERVAL_S = 60.0
# A timer fire that hit an internal error is fired again after this long (the instance is
# re-driven at once; a bug that is not transient is retried this slowly).
REFIRE_AFTER_INTERNAL_ERROR_S = 1.0


@dataclass(frozen=True, slots=True)
class ProcessorConfig:
    max_batch: int = 1000
    cache_size: int = 10_000
    # An instance whose only business is a sleep due later than this (seconds) leaves
    # the cache once its records are durable: a million sleepers do not sit in memory
    # (where every full garbage collection walks them) to be replayed in a few ms when
    # they wake.
    evict_sleepers_after_s: float = 60.0
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    # On a graceful hand-over (revoke, shutdown): how long step attempts that are
    # running may take to finish and be recorded before the partition is let go.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # How long a finished instance (status, result, history) stays readable after it
    # finished; then its state is deleted and an InstanceForgotten recorded (the Kafka
    # history topic keeps its records; the embedded log drops them). 0: for ever.
    retention_s: float = DEFAULT_RETENTION_S
    sweep_interval_s: float = SWEEP_INTERVAL_S


@dataclass(frozen=True, slots=True)
class Committed:
    """What one commit changed, for waiters: instances touched and commands settled
    (``settled_key`` of the instance and command id -> None when applied, or the reason
    it was dead-lettered)."""

    instances: list[InstanceState]
    commands: dict[str, str | None]
    replies: dict[str, Payload] = field(default_factory=dict)  # message id -> answer
