"""What an Apache Kafka node of ``apache`` is configured and formatted with: its
``server.properties``, the cluster's id kept in the data directory, and the arguments of
the storage format (``kafka-storage format``), which is where SCRAM users are created.

SCRAM credentials live in the cluster's metadata log; on a new KRaft cluster the only
way to have a user before any client connects (a broker whose clients all authenticate
with SCRAM needs one for itself, too) is to write it when the storage is formatted:
``kafka-storage format --add-scram 'SCRAM-SHA-512=[name=alice,password=...]'``.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from stepstream.ops.brokers import BrokerError

CLUSTER_FILE = "cluster.json"
SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
# The storage tool reads a credential as name=value pairs between brackets, split on
# commas: these characters cannot be in a name or a password given to it.
_SCRAM_RESERVED = frozenset(',[]"')

# A node's extra or changed server.properties, from its index and its defaults.
NodeOverrides = Callable[[int, Mapping[str, str]], Mapping[str, str]]


@dataclass(frozen=True)
class ScramUser:
    """A SCRAM credential created when the storage is formatted (a first start on new
    data): ``mechanism`` is SCRAM-SHA-256 or SCRAM-SHA-512. The password is on the
    format tool's command line for the second it runs: a local broker's users only."""

    name: str
    password: str
    mechanism: str = "SCRAM-SHA-512"

    def __post_init__(self) -> None:
        if self.mechanism not in SCRAM_MECHANISMS:
            raise BrokerError(
                f"SCRAM user {self.name!r}: mechanism {self.mechanism!r} is not one of "
                f"{', '.join(SCRAM_MECHANISMS)}"
            )
        for what, value in (("name", self.name), ("password", self.password)):
            if not value or _SCRAM_RESERVED & set(value):
                raise BrokerError(
                    f"SCRAM user {self.name!r}: the {what} must be non-empty and without "
                    f"any of {' '.join(sorted(_SCRAM_RESERVED))} (the format tool cannot "
                    "read them); choose another"
                )

    def format_argument(self) -> str:
        """The value of ``kafka-storage format --add-scram``."""
        return f"{self.mechanism}=[name={self.name},password={self.password}]"


def format_arguments(cluster_id: str, scram_users: Sequence[ScramUser] = ()) -> list[str]:
    """The arguments of ``kafka.tools.StorageTool`` that format a node's log directory,
    run in the node's directory (``server.properties`` is there)."""
    arguments = ["format", "-t", cluster_id, "-c", "server.properties"]
    for user in scram_users:
        arguments += ["--add-scram", user.format_argument()]
    return arguments


def node_properties(index: int, nodes: int, port: int, log_dir: Path) -> dict[str, str]:
    """``server.properties`` of node ``index`` of a loopback cluster of ``nodes``."""
    replicas = min(3, nodes)
    voters = ",".join(f"{i}@127.0.0.1:{port + nodes + i}" for i in range(nodes))
    return {
        "process.roles": "broker,controller",
        "node.id": str(index),
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://127.0.0.1:{port + index},"
        f"CONTROLLER://127.0.0.1:{port + nodes + index}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port + index}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(log_dir),
        "auto.create.topics.enable": "false",
        "num.partitions": "1",
        "default.replication.factor": str(replicas),
        "min.insync.replicas": "2" if nodes >= 3 else "1",
        "unclean.leader.election.enable": "false",
        "offsets.topic.replication.factor": str(replicas),
        "offsets.topic.num.partitions": "10",
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": str(min(2, nodes)),
        "transaction.state.log.num.partitions": "10",
        "share.coordinator.state.topic.replication.factor": str(replicas),
        "share.coordinator.state.topic.min.isr": str(min(2, nodes)),
        # Tests join groups with session.timeout.ms=2000 and expect a join to settle at
        # once, not after the default 3 s wait for more members.
        "group.initial.rebalance.delay.ms": "0",
        "group.min.session.timeout.ms": "500",
        "group.consumer.min.session.timeout.ms": "500",
        "group.consumer.min.heartbeat.interval.ms": "100",
        # A node restarted within the controller's session for it (9 s by default) is
        # refused (DUPLICATE_BROKER_REGISTRATION) until that session runs out, even after
        # a controlled shutdown: a rolling restart waited 8 s per node for nothing.
        "broker.session.timeout.ms": "4000",
        "broker.heartbeat.interval.ms": "1000",
        # Small-machine sizing: fewer threads, a 16 MB compaction buffer (128 MB by
        # default, taken from the heap at start).
        "num.network.threads": "2",
        "num.io.threads": "4",
        "num.recovery.threads.per.data.dir": "1",
        "log.cleaner.dedupe.buffer.size": str(16 << 20),
    }


def _cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding (what
    ``kafka-storage random-uuid`` prints, without starting a JVM for it)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):  # Kafka avoids ids that read as a command-line flag
            return text


def cluster_identity(directory: Path, nodes: int, version: str) -> str:
    """The cluster id kept in ``directory`` (made on first use), checked against the node
    count: a data directory holds one cluster and its count cannot change."""
    path = directory / CLUSTER_FILE
    if path.exists():
        kept = json.loads(path.read_text())
        if kept["nodes"] != nodes:
            raise BrokerError(
                f"{directory} holds a cluster of {kept['nodes']} node(s), not {nodes}: start "
                f"it with --nodes {kept['nodes']}, or use another --data"
            )
        cluster_id: str = kept["cluster_id"]
        return cluster_id
    cluster_id = _cluster_id()
    path.write_text(
        json.dumps({"cluster_id": cluster_id, "nodes": nodes, "kafka_version": version}) + "\n"
    )
    return cluster_id
