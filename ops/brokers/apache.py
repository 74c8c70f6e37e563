"""Apache Kafka on loopback: one node or a cluster of N, in KRaft combined mode.

Every node is both broker and controller (``process.roles=broker,controller``), with a
static quorum of all N nodes. Node ``i`` serves clients on ``port + i`` and its
controller on ``port + N + i``. Its files live in ``<data>/node-<i>/``: the generated
``server.properties``, ``log4j2.properties``, the log directory ``kafka-logs/`` and
``server.log`` (the JVM's output, appended across restarts). ``<data>/cluster.json``
keeps the cluster id and the node count, so a second start on the same data formats
nothing and finds the earlier topics and records.

Settings suit tests on a small machine: no initial rebalance delay, group sessions down
to 500 ms, no topic auto-creation, replication ``min(3, N)`` with
``min.insync.replicas`` 2 from three nodes, a 512 MB heap and a JVM that starts fast
(serial GC, C1 only; ``STEPSTREAM_BROKER_JVM_OPTS`` replaces these flags).

What a node's ``server.properties`` holds and how its storage is formatted (with SCRAM
users, for SASL listeners) is in ``apache_config``; ``start_apache(overrides=)`` changes
the properties, e.g. for TLS and SASL listeners (``tests/secure_kafka.py`` does).

``start_apache`` returns once every node serves metadata listing all N brokers. The
returned ``ApacheCluster`` stops, kills, freezes and restarts single nodes for fault
tests; each node runs in its own process group and is signalled by its pid. Processes
still running at interpreter exit are stopped; a temporary data directory is removed.
"""

from __future__ import annotations

import atexit
import importlib.resources
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepstream.ops.brokers import BrokerError
from stepstream.ops.brokers.apache_config import (
    NodeOverrides,
    ScramUser,
    cluster_identity,
    format_arguments,
    node_properties,
)
from stepstream.ops.brokers.class_archive import archive_options
from stepstream.ops.brokers.jars import (
    Progress,
    classpath,
    find_java,
    kafka_version,
    resolve_jars,
)
from stepstream.ops.brokers.ports import check_cluster_ports, free_base

DEFAULT_PORT = 9092
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
ENV_JVM_OPTS = "STEPSTREAM_BROKER_JVM_OPTS"
# Measured on 2 cores: ready in ~3.5 s with C1 only and the serial GC, ~7 s with the
# JVM's defaults. A test broker's peak throughput matters less than its start.
JVM_OPTIONS = (
    "-Xms256m",
    "-Xmx512m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
_MAIN = "kafka.Kafka"
_STORAGE_TOOL = "kafka.tools.StorageTool"


def _errors(path: Path, lines: int = 12) -> str:
    """The first ERROR and FATAL lines of a node's log (and the exception after each): why
    it stopped, which its shutdown's last lines bury."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"<no log: {exc}>"
    found: list[str] = []
    for index, line in enumerate(text):
        if " ERROR " in line or " FATAL " in line:
            found += text[index : index + 2]
        if len(found) >= lines:
            break
    return "\n".join(found[:lines]) or "<none logged>"


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<no log: {exc}>"


@dataclass
class _Node:
    index: int
    port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "server.log"

    @property
    def log_dir(self) -> Path:
        return self.directory / "kafka-logs"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ApacheCluster:
    """Apache Kafka nodes started by ``start_apache``; see the module's docstring."""

    def __init__(
        self,
        *,
        java: str,
        jars: Path,
        data: Path,
        nodes: int,
        port: int,
        owns_data: bool,
        jvm_options: Sequence[str],
        version: str,
        overrides: NodeOverrides | None = None,
        scram_users: Sequence[ScramUser] = (),
        client_properties: Mapping[str, str] | None = None,
    ) -> None:
        self.version = version
        self._overrides = overrides
        self._scram_users = tuple(scram_users)
        self.client_properties: dict[str, str] = dict(client_properties or {})
        self.data = data
        self.port = port
        self._java = java
        self._jars = jars
        self._owns_data = owns_data
        self._jvm_options = tuple(jvm_options)
        self._nodes = [_Node(i, port + i, data / f"node-{i}") for i in range(nodes)]
        self._stopped = False
        atexit.register(self.stop)

    # ---- what clients and tests read -----------------------------------------------

    @property
    def nodes(self) -> int:
        return len(self._nodes)

    @property
    def bootstrap(self) -> str:
        return ",".join(node.address for node in self._nodes)

    def address(self, index: int) -> str:
        return self._nodes[index].address

    def pid(self, index: int) -> int:
        proc = self._nodes[index].proc
        if proc is None:
            raise BrokerError(f"node {index} was never started")
        return proc.pid

    @property
    def pids(self) -> list[int]:
        return [self.pid(i) for i in range(self.nodes)]

    def running(self, index: int) -> bool:
        return self._nodes[index].running()

    def log_path(self, index: int) -> Path:
        return self._nodes[index].log_path

    def log_tail(self, index: int = 0, lines: int = 40) -> str:
        return _tail(self._nodes[index].log_path, lines)

    def log_tails(self, lines: int = 20) -> str:
        return "\n".join(
            f"--- node {node.index} ({node.log_path}) ---\n{_tail(node.log_path, lines)}"
            for node in self._nodes
        )

    # ---- lifecycle --------------------------------------------------------------------

    def prepare(self, cluster_id: str) -> None:
        """Write every node's configuration, and format the log directories that are not
        formatted yet (in parallel: a JVM each)."""
        log4j = (
            importlib.resources.files("stepstream.ops.brokers") / "apache-log4j2.properties"
        ).read_text()
        formats: list[tuple[_Node, subprocess.Popen[bytes]]] = []
        for node in self._nodes:
            node.directory.mkdir(parents=True, exist_ok=True)
            properties = node_properties(node.index, self.nodes, self.port, node.log_dir)
            if self._overrides is not None:
                properties.update(self._overrides(node.index, properties))
            (node.directory / "server.properties").write_text(
                "".join(f"{key}={value}\n" for key, value in properties.items())
            )
            (node.directory / "log4j2.properties").write_text(log4j)
            if not (node.log_dir / "meta.properties").exists():
                command = self._java_command(node, _STORAGE_TOOL)
                command += format_arguments(cluster_id, self._scram_users)
                formats.append((node, self._spawn(node, command)))
        for node, proc in formats:
            if proc.wait(timeout=STOP_TIMEOUT_S) != 0:
                raise BrokerError(
                    f"formatting node {node.index}'s storage failed (exit {proc.returncode}):"
                    f"\n{self.log_tail(node.index)}"
                )

    def _java_command(self, node: _Node, main: str) -> list[str]:
        return [
            self._java,
            *self._jvm_options,
            f"-Dlog4j2.configurationFile={node.directory / 'log4j2.properties'}",
            "-cp",
            classpath(self._jars),
            main,
        ]

    def _spawn(self, node: _Node, command: list[str]) -> subprocess.Popen[bytes]:
        """A JVM in its own session (so its group id is its pid), output to its log."""
        with open(node.log_path, "ab") as log:
            return subprocess.Popen(
                command,
                cwd=node.directory,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_node(
        self, index: int, *, wait: bool = True, timeout: float = START_TIMEOUT_S
    ) -> None:
        """Start node ``index`` on its existing data; with ``wait``, return once it serves
        metadata and lists itself among the brokers."""
        node = self._nodes[index]
        if node.running():
            raise BrokerError(f"node {index} is already running (pid {self.pid(index)})")
        node.proc = self._spawn(node, [*self._java_command(node, _MAIN), "server.properties"])
        self._stopped = False
        if wait:
            self.wait_ready([index], timeout=timeout, brokers=None)

    def wait_ready(
        self,
        indexes: Sequence[int] | None = None,
        *,
        timeout: float = START_TIMEOUT_S,
        brokers: int | None = None,
    ) -> None:
        """Until each node of ``indexes`` (all by default) answers a metadata request
        listing itself, and at least ``brokers`` brokers (all N when ``indexes`` is None).
        Raises ``BrokerError`` with the log tails if a node exits or time runs out."""
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        if indexes is None:
            indexes = range(self.nodes)
            brokers = self.nodes if brokers is None else brokers
        waiting = list(indexes)
        admins = {
            i: AdminClient(
                {**self.client_properties, "bootstrap.servers": self.address(i), "log_level": 0}
            )
            for i in waiting
        }
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while waiting:
            for i in list(waiting):
                node = self._nodes[i]
                if not node.running():
                    code = node.proc.returncode if node.proc else None
                    raise BrokerError(
                        f"Apache Kafka node {i} exited with code {code} while starting "
                        f"(log {node.log_path}); its errors:\n{_errors(node.log_path)}\n"
                        f"its last lines:\n{self.log_tail(i)}"
                    )
                try:
                    metadata = admins[i].list_topics(timeout=1)
                except KafkaException as exc:
                    last = f"node {i}: {exc}"
                    continue
                seen = set(metadata.brokers)
                if i in seen and len(seen) >= (brokers or 0):
                    waiting.remove(i)
                else:
                    last = f"node {i} lists brokers {sorted(seen)}"
            if waiting and time.monotonic() > deadline:
                raise BrokerError(
                    f"Apache Kafka nodes {waiting} not serving metadata after {timeout:.0f} s "
                    f"({last})\n{self.log_tails()}"
                )
            if waiting:
                time.sleep(0.2)

    def stop_node(self, index: int, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (a controlled shutdown) and wait; SIGKILL after ``timeout``. Returns
        the exit code (None if it was not running)."""
        node = self._nodes[index]
        if not node.running():
            return node.proc.returncode if node.proc else None
        self._signal(index, signal.SIGCONT)  # a frozen node cannot shut down
        self._signal(index, signal.SIGTERM)
        return self._reap(node, timeout)

    def kill_node(self, index: int) -> None:
        """SIGKILL: the node stops at once, as in a crash."""
        node = self._nodes[index]
        if node.running():
            self._signal(index, signal.SIGKILL)
            self._reap(node, STOP_TIMEOUT_S)

    def freeze_node(self, index: int) -> None:
        """SIGSTOP: the node keeps its sockets but answers nothing (a long GC pause, a
        partitioned host) until ``thaw_node``."""
        self._signal(index, signal.SIGSTOP)

    def thaw_node(self, index: int) -> None:
        self._signal(index, signal.SIGCONT)

    def stop(self) -> None:
        """Stop every node (controlled shutdowns, in parallel) and remove the data
        directory if it is a temporary one; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        running = [node for node in self._nodes if node.running()]
        for node in running:
            self._signal(node.index, signal.SIGCONT)
            self._signal(node.index, signal.SIGTERM)
        for node in running:
            self._reap(node, STOP_TIMEOUT_S)
        if self._owns_data:
            shutil.rmtree(self.data, ignore_errors=True)
        atexit.unregister(self.stop)

    def _signal(self, index: int, signum: int) -> None:
        try:
            os.killpg(self.pid(index), signum)  # its own session: group id == pid
        except ProcessLookupError:
            pass

    @staticmethod
    def _reap(node: _Node, timeout: float) -> int | None:
        assert node.proc is not None
        try:
            return node.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(node.proc.pid, signal.SIGKILL)
            return node.proc.wait(timeout=timeout)

    def __enter__(self) -> ApacheCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_apache(
    nodes: int = 1,
    port: int | None = None,
    data: str | os.PathLike[str] | None = None,
    *,
    version: str | None = None,
    timeout: float = START_TIMEOUT_S,
    jvm_options: Sequence[str] | None = None,
    progress: Progress | None = None,
    overrides: NodeOverrides | None = None,
    scram_users: Sequence[ScramUser] = (),
    client_properties: Mapping[str, str] | None = None,
) -> ApacheCluster:
    """Start ``nodes`` Apache Kafka nodes on loopback and return once every one serves
    metadata listing all of them.

    ``port`` is node 0's client port (free ports when None); ``data`` keeps the cluster
    across starts (a temporary directory, removed by ``stop()``, when None). ``overrides``
    gives a node's extra or changed ``server.properties`` from its index and its defaults
    (another listener, SASL or TLS settings). ``scram_users`` are created when new storage
    is formatted (a broker that authenticates with SCRAM needs its own user before it
    starts); ``client_properties`` are what a client needs to reach the nodes' client
    listeners (librdkafka names: ``security.protocol``, ``sasl.*``, ``ssl.*``): the
    readiness check uses them, and they are kept as ``cluster.client_properties``. The
    jars are resolved first if they are not cached (``progress`` hears about it). Raises
    ``BrokerError`` with the reason and the nodes' log tails if the cluster cannot start.
    """
    if nodes < 1:
        raise BrokerError(f"--nodes must be at least 1, got {nodes}")
    version = version or kafka_version()
    java = find_java()
    jars = resolve_jars(version, progress=progress)
    if port is not None:
        check_cluster_ports(port, nodes)
    options = _configured_jvm_options() if jvm_options is None else tuple(jvm_options)
    jvm_options = (*options, *_class_archive(java, jars, version, options, progress))
    attempts = 3 if port is None else 1
    for attempt in range(attempts):
        chosen = port if port is not None else free_base(2 * nodes)
        try:
            return _start(
                data,
                nodes,
                version,
                timeout,
                java=java,
                jars=jars,
                port=chosen,
                jvm_options=jvm_options,
                overrides=overrides,
                scram_users=scram_users,
                client_properties=client_properties,
            )
        except BrokerError as exc:
            # A free port taken by someone else between the probe and the bind.
            if "Address already in use" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def prepare_apache(version: str | None = None, progress: Progress | None = None) -> Path:
    """What a first start needs, done beforehand (``stepstream broker --apache
    --prepare``): Java checked, the jars resolved into their cache and the class-data
    archive made. Returns the jar directory."""
    version = version or kafka_version()
    java = find_java()
    jars = resolve_jars(version, progress=progress)
    _class_archive(java, jars, version, _configured_jvm_options(), progress)
    return jars


def _configured_jvm_options() -> tuple[str, ...]:
    configured = os.environ.get(ENV_JVM_OPTS)
    return tuple(shlex.split(configured)) if configured else JVM_OPTIONS


def _class_archive(
    java: str, jars: Path, version: str, jvm_options: tuple[str, ...], progress: Progress | None
) -> list[str]:
    """The options that map the broker's class-data archive (``class_archive``), made
    here the first time by a one-node broker that starts, serves and stops."""

    def make(archiving: Sequence[str]) -> None:
        cluster = _start(
            None,
            1,
            version,
            START_TIMEOUT_S,
            java=java,
            jars=jars,
            port=free_base(2),
            jvm_options=(*jvm_options, *archiving),
        )
        code = cluster.stop_node(0)
        cluster.stop()
        if code not in (0, 128 + signal.SIGTERM):
            raise BrokerError(f"the archiving node exited with code {code}")

    return archive_options(jars, java, jvm_options, make, progress)


def _start(
    data: str | os.PathLike[str] | None, nodes: int, version: str, timeout: float, **options: Any
) -> ApacheCluster:
    owns_data = data is None
    # Absolute: each node runs in its own directory, and server.properties and the
    # log4j configuration name paths under this one.
    directory = (
        Path(tempfile.mkdtemp(prefix="stepstream-kafka-")) if data is None else Path(data)
    ).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    cluster_id = cluster_identity(directory, nodes, version)
    cluster = ApacheCluster(
        data=directory, nodes=nodes, owns_data=owns_data, version=version, **options
    )
    try:
        cluster.prepare(cluster_id)
        for index in range(nodes):
            cluster.start_node(index, wait=False)
        cluster.wait_ready(timeout=timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster
