"""Making confluent-kafka clients, and calling them while the cluster moves.

A configuration librdkafka refuses (a misspelt property, a bad value) becomes a
``KafkaSettingsError`` that says which client and why, instead of a traceback; a cluster
that refuses the client's SASL login or TLS handshake, a ``KafkaAuthenticationFailed``
that names the settings to check (``Refusals``). A call
that meets a leader election or a moving coordinator is made again until the cluster
settles (``through_elections``), instead of stopping the worker."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException

from stepstream.engine.config.kafka import KafkaSettingsError, authentication_failed

C = TypeVar("C")
log = logging.getLogger("stepstream.kafka.clients")


def make_client(factory: Callable[[dict[str, Any]], C], config: dict[str, Any], what: str) -> C:
    try:
        return factory(config)
    except (KafkaException, ValueError, TypeError) as exc:
        raise KafkaSettingsError(
            f"the Kafka {what} refused its configuration: {exc}; check --kafka-opt, "
            "--kafka-config and STEPSTREAM_KAFKA_* variables"
        ) from None


# librdkafka errors that trying again does not clear, and whether each is TLS's.
_REFUSED = {KafkaError._AUTHENTICATION: False, KafkaError._SSL: True}


class Refusals:
    """A client's ``error_cb`` that keeps the first refused SASL login or failed TLS
    handshake: librdkafka only reports those through the callback (a metadata request
    just times out, as if the broker were down) and tries again for ever."""

    def __init__(self) -> None:
        self.error: KafkaError | None = None

    def __call__(self, err: KafkaError) -> None:
        if self.error is None and err.code() in _REFUSED:
            self.error = err

    def raise_if_refused(self, bootstrap: str) -> None:
        if self.error is not None:
            tls = _REFUSED[self.error.code()]
            raise authentication_failed(bootstrap, self.error.str(), tls=tls)


T = TypeVar("T")
# How long a call keeps trying through errors the cluster clears by itself: a leader
# election after a broker died takes seconds; a controller's session expiry up to ~20 s.
RETRIABLE_FOR_S = 60.0


def through_elections(
    call: Callable[[], T], what: str, *, deadline_s: float = RETRIABLE_FOR_S
) -> T:
    """``call()``, again while it fails with an error librdkafka marks retriable (no
    leader for a partition, a coordinator moving, a broker down), for up to
    ``deadline_s``; the last error is raised after that. Blocking: call from a thread."""
    began = time.monotonic()
    pause = 0.1
    while True:
        try:
            return call()
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            retriable = isinstance(error, KafkaError) and (
                error.retriable() or error.code() in _ALSO_TRANSIENT
            )
            if not retriable or time.monotonic() - began > deadline_s:
                raise
            log.warning("%s: %s; trying again (the cluster is moving a leader)", what, error)
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


# Errors librdkafka does not mark retriable that a moving cluster still clears by itself.
_ALSO_TRANSIENT = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN,
        # A request in flight to a broker that left the cluster's metadata (it died):
        # librdkafka drops that broker's handle; the next try goes to the new leader.
        KafkaError._DESTROY_BROKER,
        # A partition the client's metadata does not know yet: the cluster is starting.
        KafkaError._UNKNOWN_PARTITION,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
    }
)
