"""Which loopback ports a local broker may take: a port something listens on is taken,
one that only a stopped server's connections hold (TIME-WAIT) is not, and the error
names what is taken."""

from __future__ import annotations

import socket

import pytest

from stepstream.ops.brokers import BrokerError
from stepstream.ops.brokers.ports import check_cluster_ports, free_base, is_free


def test_a_listening_port_is_taken_and_a_closed_one_is_free() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert not is_free(port)
    assert is_free(port)


def test_a_port_whose_server_stopped_with_connections_in_time_wait_is_free() -> None:
    """A broker stopped and started again at once: its side of each client connection
    lingers in TIME-WAIT on its port for a minute, which must not refuse the start."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)) as client:
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: it is the one in TIME-WAIT
        server.close()
        assert client.recv(1) == b""
    assert is_free(port)


def test_the_error_names_each_taken_port_and_what_the_nodes_need() -> None:
    base = free_base(4)
    with socket.socket() as one, socket.socket() as two:
        for sock, port in ((one, base + 1), (two, base + 3)):
            sock.bind(("127.0.0.1", port))
            sock.listen()
        with pytest.raises(BrokerError) as taken:
            check_cluster_ports(base, 2)
    message = str(taken.value)
    assert f"ports {base + 1}, {base + 3} are in use on 127.0.0.1" in message, message
    assert f"need {base}-{base + 3}" in message and "choose another --port" in message
    check_cluster_ports(base, 2)  # free again: no error
