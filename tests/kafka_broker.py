"""The Kafka brokers the tests run on.

Every Kafka test runs on Apache Kafka itself (``start_test_kafka``: one KRaft node from
its Maven Central jars, ``stepstream broker --apache``); fault tests that need replicas
start a cluster of three with ``start_test_kafka(3)``. The development broker (Tansu,
``start_dev_broker``) stays only where a test needs what Apache Kafka cannot give on one
machine: see ``tests/faults/test_network_faults.py``.
"""

from __future__ import annotations

from typing import Protocol

from stepstream.ops.brokers.apache import ApacheCluster, start_apache
from stepstream.ops.brokers.dev import Broker as DevBroker
from stepstream.ops.brokers.dev import start_broker as start_dev_broker


class Broker(Protocol):
    """What a test needs of a running broker, whichever it is."""

    @property
    def bootstrap(self) -> str: ...

    def stop(self) -> None: ...


def start_test_kafka(nodes: int = 1) -> ApacheCluster:
    """Apache Kafka for a test session; raises ``BrokerError`` with the nodes' log tails
    if it cannot start (never a skip)."""
    return start_apache(nodes)


def discard(cluster: ApacheCluster) -> None:
    """Stop a throwaway cluster at once: kill -9 every node, then ``stop()`` removes its
    data. Nothing on it is kept, so a controlled shutdown (seconds per node, more with
    three nodes under load) buys a test nothing."""
    for index in range(cluster.nodes):
        cluster.kill_node(index)
    cluster.stop()


__all__ = [
    "ApacheCluster",
    "Broker",
    "DevBroker",
    "discard",
    "start_dev_broker",
    "start_test_kafka",
]
