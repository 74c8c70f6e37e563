"""Loopback ports for local brokers: finding a free run of them, and saying which of a
chosen run are taken before a node fails to bind one."""

from __future__ import annotations

import socket

from stepstream.ops.brokers import BrokerError


def free_base(count: int) -> int:
    """A port P with P..P+count-1 all free on loopback right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base: int = probe.getsockname()[1]
        if base + count < 65536 and all(is_free(base + i) for i in range(count)):
            return base
    raise BrokerError(f"found no {count} consecutive free ports on 127.0.0.1")


def is_free(port: int) -> bool:
    """Nothing listens on ``port`` (connections of a stopped server in TIME-WAIT do not
    count: brokers bind with SO_REUSEADDR too, so a stop and start at once works)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def check_cluster_ports(port: int, nodes: int) -> None:
    """Raise ``BrokerError`` naming what is taken of the 2N ports ``nodes`` Apache Kafka
    nodes from ``port`` on need: clients on the first N, controllers on the next N."""
    taken = [p for p in range(port, port + 2 * nodes) if not is_free(p)]
    if taken:
        which = (
            f"port {taken[0]} is" if len(taken) == 1 else f"ports {', '.join(map(str, taken))} are"
        )
        raise BrokerError(
            f"{which} in use on 127.0.0.1; {nodes} node(s) "
            f"from --port {port} need {port}-{port + 2 * nodes - 1} (clients on the "
            f"first {nodes}, controllers on the rest): choose another --port"
        )
