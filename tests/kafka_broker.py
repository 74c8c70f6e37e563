"""The test broker lives in ``ops.broker`` (the Kafka bench starts it too)."""

from stepstream.ops.broker import Broker, start_broker

__all__ = ["Broker", "start_broker"]
