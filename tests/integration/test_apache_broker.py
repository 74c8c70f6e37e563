"""Apache Kafka from its Maven Central jars (``stepstream broker --apache``), and the topic
settings check, against real JVMs: one node and a cluster of three.

Nothing here skips: a broker that cannot start fails the test with the reason and its
log tail (``BrokerError``). The first run resolves the jars with Maven (``.ci/run`` does
that beforehand with ``stepstream broker --apache --prepare``).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from confluent_kafka.admin._config import AlterConfigOpType, ConfigEntry, ConfigResource

from stepstream.ops.brokers.apache import ApacheCluster, start_apache
from stepstream.ops.brokers.jars import resolve_jars
from stepstream.ops.brokers.ports import free_base
from tests.kafka_broker import discard
from tests.processes import repo_env

CLI = [sys.executable, "-m", "stepstream.ops.cli"]


def _produce(bootstrap: str, topic: str, value: bytes) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})
    errors: list[object] = []
    producer.produce(topic, value, key=b"k", on_delivery=lambda e, _m: errors.append(e))
    assert producer.flush(30) == 0, "not delivered in 30 s"
    assert errors == [None], errors


def _consume_all(bootstrap: str, topic: str, count: int) -> list[bytes]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"g{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 2000,
            "heartbeat.interval.ms": 300,
        }
    )
    consumer.subscribe([topic])
    values: list[bytes] = []
    deadline = time.monotonic() + 60
    try:
        while len(values) < count and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                values.append(message.value())
    finally:
        consumer.close()
    return values


def _create_topic(bootstrap: str, topic: str, replicas: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, 1, replicas)]).values():
        future.result(timeout=30)


def _first_line(proc: subprocess.Popen[str], log: Path, timeout: float = 180) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().strip() if ready else ""
    assert line, f"no bootstrap line in {timeout:.0f} s:\n{log.read_text()[-3000:]}"
    return line


@pytest.mark.slow
def test_one_node_serves_what_it_acknowledged() -> None:
    with start_apache(1) as cluster:
        assert cluster.bootstrap.count(",") == 0
        assert cluster.pid(0) > 0
        _create_topic(cluster.bootstrap, "one.records")
        _produce(cluster.bootstrap, "one.records", b"hello")
        assert _consume_all(cluster.bootstrap, "one.records", 1) == [b"hello"]
        assert "Kafka Server started" in cluster.log_tail(0, 400), cluster.log_tail(0)
    assert not cluster.data.exists()  # a temporary data directory goes with stop()


@pytest.mark.slow
def test_the_broker_command_stops_on_sigterm_and_keeps_its_data(tmp_path: Path) -> None:
    data = tmp_path / "kafka"
    port = free_base(2)
    log = tmp_path / "broker.err"

    def start() -> tuple[subprocess.Popen[str], str]:
        # A relative --data, as docs/brokers.md shows it.
        command = [*CLI, "broker", "--apache", "--port", str(port), "--data", "./kafka"]
        with open(log, "a") as err:
            proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=repo_env(),
                cwd=tmp_path,
            )
        return proc, _first_line(proc, log)

    def stop(proc: subprocess.Popen[str]) -> None:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)  # waits, and closes the stdout pipe
        assert proc.returncode == 0, log.read_text()[-3000:]

    proc, bootstrap = start()
    try:
        assert bootstrap == f"127.0.0.1:{port}"
        _create_topic(bootstrap, "kept.records")
        _produce(bootstrap, "kept.records", b"survives a restart")
    finally:
        stop(proc)
    assert (data / "cluster.json").exists()
    assert (data / "node-0" / "kafka-logs" / "meta.properties").exists()  # the page's layout
    server_log = (data / "node-0" / "server.log").read_text()
    assert "Kafka Server started" in server_log or "started (kafka" in server_log, server_log
    proc, bootstrap = start()
    try:
        assert _consume_all(bootstrap, "kept.records", 1) == [b"survives a restart"]
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def three_nodes() -> Iterator[ApacheCluster]:
    cluster = start_apache(3)
    try:
        yield cluster
    finally:
        discard(cluster)


def _topics(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "topics", *args], capture_output=True, text=True, env=repo_env(), timeout=120
    )


@pytest.mark.slow
def test_three_nodes_with_replicated_topics_pass_the_check(three_nodes: ApacheCluster) -> None:
    metadata = AdminClient({"bootstrap.servers": three_nodes.bootstrap}).list_topics(timeout=10)
    assert sorted(metadata.brokers) == [0, 1, 2]
    prefix = f"rf3{uuid.uuid4().hex[:6]}"
    created = _topics(
        "create",
        "--bootstrap",
        three_nodes.bootstrap,
        "--prefix",
        prefix,
        "--partitions",
        "3",
        "--replication-factor",
        "3",
        "--min-insync",
        "2",
    )
    assert created.returncode == 0, created.stderr
    checked = _topics("check", "--bootstrap", three_nodes.bootstrap, "--prefix", prefix)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "keep every guarantee" in checked.stdout
    topic = AdminClient({"bootstrap.servers": three_nodes.bootstrap}).list_topics(
        f"{prefix}.history", timeout=10
    )
    assert all(len(p.replicas) == 3 for p in topic.topics[f"{prefix}.history"].partitions.values())

    # One node down of three: min.insync.replicas=2 still acknowledges writes.
    three_nodes.stop_node(2)
    try:
        _produce(three_nodes.bootstrap, f"{prefix}.commands", b"with a node down")
    finally:
        three_nodes.start_node(2)
    assert three_nodes.running(2)


@pytest.mark.slow
def test_the_check_names_one_replica_topics(three_nodes: ApacheCluster) -> None:
    prefix = f"rf1{uuid.uuid4().hex[:6]}"
    created = _topics(
        "create", "--bootstrap", three_nodes.bootstrap, "--prefix", prefix, "--partitions", "2"
    )
    assert created.returncode == 0, created.stderr
    assert "existed already" not in created.stdout
    again = _topics(
        "create", "--bootstrap", three_nodes.bootstrap, "--prefix", prefix, "--partitions", "2"
    )
    assert again.returncode == 0, again.stderr
    assert "existed already" in again.stdout and "topics check" in again.stdout
    checked = _topics("check", "--bootstrap", three_nodes.bootstrap, "--prefix", prefix)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert f"{prefix}.history: replication factor 1" in checked.stdout
    # Set on the topic, so the cluster's default of 2 cannot refuse every write.
    assert "min.insync.replicas" not in checked.stdout


@pytest.mark.slow
def test_the_check_names_a_history_deleted_by_age(three_nodes: ApacheCluster) -> None:
    prefix = f"del{uuid.uuid4().hex[:6]}"
    bootstrap = three_nodes.bootstrap
    created = _topics(
        "create", "--bootstrap", bootstrap, "--prefix", prefix, "--partitions", "2",
        "--replication-factor", "3",
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        f"{prefix}.history",
        incremental_configs=[
            ConfigEntry("retention.ms", "604800000", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=30)
    checked = _topics("check", "--bootstrap", bootstrap, "--prefix", prefix, "--json")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    findings = json.loads(checked.stdout)
    assert [(f["topic"], f["problem"].split(":")[0]) for f in findings] == [
        (f"{prefix}.history", "retention.ms=604800000")
    ]
    assert "--add-config retention.ms=-1" in findings[0]["fix"]


def test_without_java_the_error_says_what_to_install(tmp_path: Path) -> None:
    env = repo_env(PATH=str(tmp_path))  # no java (nor anything else) on PATH
    env.pop("JAVA_HOME", None)
    done = subprocess.run(
        [*CLI, "broker", "--apache", "--port", str(free_base(2))],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "needs Java 17+" in done.stderr and "no java on PATH" in done.stderr, done.stderr
    assert "openjdk-17-jre-headless" in done.stderr


def test_without_maven_the_error_says_what_to_install(tmp_path: Path) -> None:
    java = subprocess.run(
        ["sh", "-c", "command -v java"], capture_output=True, text=True
    ).stdout.strip()
    assert java, "the tests need java on PATH"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "java").symlink_to(os.path.realpath(java))
    env = repo_env(PATH=str(bin_dir), STEPSTREAM_BROKER_JARS=str(tmp_path / "jars"))
    env.pop("JAVA_HOME", None)
    done = subprocess.run(
        [*CLI, "broker", "--apache", "--prepare"], capture_output=True, text=True, env=env,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "needs Maven (mvn on PATH)" in done.stderr, done.stderr
    assert "apt-get install maven" in done.stderr


def test_a_taken_controller_port_is_named_before_anything_starts(tmp_path: Path) -> None:
    """One node on --port P listens on P and its controller on P+1: if P+1 is held, the
    command says so at once instead of a node that dies while the shell waits."""
    port = free_base(2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port + 1))
        holder.listen()
        done = subprocess.run(
            [*CLI, "broker", "--apache", "--port", str(port), "--data", str(tmp_path / "k")],
            capture_output=True,
            text=True,
            env=repo_env(),
            timeout=60,
        )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"port {port + 1} is in use on 127.0.0.1" in done.stderr, done.stderr
    assert "choose another --port" in done.stderr, done.stderr
    assert done.stdout == "", done.stdout
    assert not (tmp_path / "k" / "node-0").exists()


def _mapped_archives(pid: int, directory: Path) -> set[str]:
    """The class-data archives in ``directory`` that process ``pid`` maps (the JDK's own
    lives elsewhere)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps if line.endswith(".jsa")} & {
        str(path) for path in directory.glob("*.jsa")
    }


@pytest.mark.slow
def test_prepare_archives_the_classes_and_nodes_start_from_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--prepare`` makes the class-data archive beside the jars (a node then starts in
    about two thirds of the time), and a node started from those jars maps it."""
    cached = resolve_jars()
    jars = tmp_path / "jars"
    jars.mkdir()
    for jar in cached.glob("*.jar"):
        (jars / jar.name).symlink_to(jar)
    shutil.copy(cached / ".complete", jars / ".complete")
    done = subprocess.run(
        [*CLI, "broker", "--apache", "--prepare"],
        capture_output=True,
        text=True,
        env=repo_env(STEPSTREAM_BROKER_JARS=str(jars)),
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "archiving the broker's classes" in done.stderr, done.stderr
    archives = [str(path) for path in jars.glob("classes-*.jsa")]
    assert len(archives) == 1, archives
    monkeypatch.setenv("STEPSTREAM_BROKER_JARS", str(jars))
    with start_apache(1) as cluster:
        assert _mapped_archives(cluster.pid(0), jars) == set(archives)
