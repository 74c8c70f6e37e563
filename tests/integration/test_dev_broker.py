"""``stepstream broker`` without ``--apache``: the pip-installed development broker for
users without Java. It prints its bootstrap address once it serves metadata, stops on
SIGTERM, and refuses a port something else listens on instead of calling that ready; and
``topics check`` is not fooled by its one node listed as several replicas."""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import sys

from confluent_kafka.admin import AdminClient

from stepstream.ops.brokers.ports import free_base
from tests.kafka_broker import start_dev_broker
from tests.processes import repo_env

CLI = [sys.executable, "-m", "stepstream.ops.cli", "broker"]
TOPICS = [sys.executable, "-m", "stepstream.ops.cli", "topics"]


def test_the_development_broker_serves_and_stops_on_sigterm() -> None:
    port = free_base(1)
    proc = subprocess.Popen(
        [*CLI, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=repo_env(),
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no bootstrap line within 60 s"
        assert proc.stdout.readline().strip() == f"127.0.0.1:{port}"
        metadata = AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"}).list_topics(timeout=10)
        assert len(metadata.brokers) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_a_port_in_use_is_refused_before_anything_starts() -> None:
    port = free_base(1)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        done = subprocess.run(
            [*CLI, "--port", str(port)], capture_output=True, text=True, env=repo_env(), timeout=60
        )
    assert done.returncode == 1, done
    assert f"port {port} is in use on 127.0.0.1: choose another --port" in done.stderr
    assert done.stdout == "", done.stdout  # no bootstrap line a script would take as ready


def test_topics_check_counts_one_node_listed_three_times_as_one_replica() -> None:
    """The development broker accepts --replication-factor 3 and lists its one node as
    each of the three replicas: check must still say the topics are not replicated."""
    with start_dev_broker() as broker:
        where = ["--bootstrap", broker.bootstrap, "--prefix", "dup"]
        created = subprocess.run(
            [*TOPICS, "create", *where, "--partitions", "4", "--replication-factor", "3"],
            capture_output=True,
            text=True,
            env=repo_env(),
            timeout=60,
        )
        assert created.returncode == 0, created.stderr
        check = subprocess.run(
            [*TOPICS, "check", *where], capture_output=True, text=True, env=repo_env(), timeout=60
        )
    assert check.returncode == 1, check.stdout + check.stderr
    assert "replication factor 1" in check.stdout + check.stderr, check.stdout
