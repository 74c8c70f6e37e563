"""Making confluent-kafka clients: a configuration librdkafka refuses (a misspelt
property, a bad value) becomes a ``KafkaSettingsError`` that says which client and why,
instead of a traceback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import KafkaException

from stepstream.engine.config.kafka import KafkaSettingsError

C = TypeVar("C")


def make_client(factory: Callable[[dict[str, Any]], C], config: dict[str, Any], what: str) -> C:
    try:
        return factory(config)
    except (KafkaException, ValueError, TypeError) as exc:
        raise KafkaSettingsError(
            f"the Kafka {what} refused its configuration: {exc}; check --kafka-opt, "
            "--kafka-config and STEPSTREAM_KAFKA_* variables"
        ) from None
