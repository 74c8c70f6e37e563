"""The test broker lives in ``ops.brokers.dev`` (the Kafka bench starts it too)."""

from stepstream.ops.brokers.dev import Broker, start_broker

__all__ = ["Broker", "start_broker"]
