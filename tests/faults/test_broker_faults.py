"""Faults of Apache Kafka itself, under a running workload, on a cluster of three.

The crash checker's workload (``tests/faults/test_crash_checker.py``: two ``stepstream
worker`` processes in one group, clients sending events, pausing, resuming and
cancelling) runs on three Apache Kafka nodes with every topic at replication factor 3
and ``min.insync.replicas=2``. Instead of killing workers, each test does one thing to
the brokers while the workload runs:

- kill -9 the leader of a commands partition (and start it again later);
- restart all three brokers one after another, each back in sync before the next;
- freeze one broker with SIGSTOP past its session with the controller, then thaw it;
- stop the whole cluster and start it again from its data;
- cut one worker off from every broker (its connections go through TCP proxies, which
  stop forwarding) while the other goes on, then let it back.

Then the checker folds the history topic and asserts design.md's guarantees for every
instance (each acknowledged command applied exactly once, no transition lost or
repeated, attempts within their policy). The tests share one cluster, made whole again
before each (every node running and serving, every proxy healed), and each runs on
topics of its own. The time to recover is how long a new instance,
started as the fault begins (for a whole-cluster restart, once the cluster is back),
takes from the fault's beginning to its completion; it is printed with the summary.
"""

from __future__ import annotations

import asyncio
import random
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from stepstream.engine.wire.topics import COMMANDS, TopicNames
from stepstream.ops.brokers.apache import ApacheCluster, start_apache
from tests.faults.test_crash_checker import Kafka, Proc, run_checker
from tests.kafka_broker import discard
from tests.tcp_proxy import TcpProxy

# One pytest-xdist worker runs them all, on one cluster (``--dist loadgroup``).
pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.xdist_group("broker-faults")]

Note = Callable[[str], None]
# A broker frozen longer than this is fenced by the controller (broker.session.timeout.ms
# is 4 s on these nodes, 9 s by Kafka's default), so its partitions' leadership moves.
FROZEN_S = 7.0
IN_SYNC_TIMEOUT_S = 90.0
PROBE_TIMEOUT_S = 180.0


class ClusterFaults(Kafka):
    """The crash checker's Kafka backend on three brokers: its one fault is ``fault``."""

    name = "kafka, 3 brokers"
    replication = 3

    def __init__(
        self,
        root: Path,
        cluster: ApacheCluster,
        fault: Callable[[ClusterFaults, Note], Awaitable[None]],
    ) -> None:
        super().__init__(root, cluster)
        self.cluster = cluster
        self.fault = fault
        self.recovered_s: float | None = None
        self._probe: asyncio.Task[float] | None = None
        self._began = 0.0

    async def kill_and_restart(self, rng: random.Random, note: Note) -> None:
        await self._revive(note)
        self._began = time.monotonic()
        await self.fault(self, note)
        if self._probe is None:
            self.probe_now(note)
        assert self._probe is not None
        self.recovered_s = await self._probe

    def probe_now(self, note: Note) -> None:
        """Start the probe while the fault still holds: the time to recover counts from
        the fault's beginning to the probe's completion."""
        self._probe = asyncio.ensure_future(self.probe(note, self._began))

    async def probe(self, note: Note, began: float) -> float:
        """Start a one-step instance (checked like the others) and wait for its result:
        the seconds from ``began`` until the engine completed it."""
        assert self.workload is not None
        instance = f"probe-{len(self.workload.plans)}"
        self.workload.plans[instance] = {
            "ops": [{"op": "step", "key": "p", "max": 1, "fail": 0, "seconds": 0, "async": True}]
        }
        async with self.client() as client:
            await self.workload.start(client, instance)
            await client.result(instance, timeout=PROBE_TIMEOUT_S)
        took = time.monotonic() - began
        note(f"recovered: {instance} completed {took:.1f} s after the fault began")
        return took

    def leader_of_commands(self, partition: int = 0) -> int:
        topic = TopicNames(self.settings.prefix).name(COMMANDS)
        metadata = self._admin().list_topics(topic, timeout=10)
        return int(metadata.topics[topic].partitions[partition].leader)

    def _admin(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.cluster.bootstrap, "log_level": 0})

    def wait_in_sync(self, note: Note) -> None:
        """Until every partition of this prefix's topics has all three replicas in sync."""
        prefix = f"{self.settings.prefix}."
        deadline = time.monotonic() + IN_SYNC_TIMEOUT_S
        began = time.monotonic()
        while True:
            lagging = [
                f"{name}/{p}"
                for name, topic in self._admin().list_topics(timeout=10).topics.items()
                if name.startswith(prefix)
                for p, part in topic.partitions.items()
                if len(part.isrs) < 3
            ]
            if not lagging:
                note(f"every replica in sync again after {time.monotonic() - began:.1f} s")
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"replicas still out of sync: {lagging}")
            time.sleep(0.5)


async def kill9_a_leader(backend: ClusterFaults, note: Note) -> None:
    cluster = backend.cluster
    leader = await asyncio.to_thread(backend.leader_of_commands)
    await asyncio.to_thread(cluster.kill_node, leader)
    note(f"kill -9 broker {leader}, leader of commands partition 0")
    backend.probe_now(note)
    # The cluster goes on with two brokers (min.insync.replicas=2) while it is down.
    await asyncio.sleep(3)
    await asyncio.to_thread(cluster.start_node, leader)
    note(f"broker {leader} started again")
    await asyncio.to_thread(backend.wait_in_sync, note)


async def rolling_restart(backend: ClusterFaults, note: Note) -> None:
    cluster = backend.cluster
    for node in range(cluster.nodes):
        began = time.monotonic()
        code = await asyncio.to_thread(cluster.stop_node, node)
        if node == 0:
            backend.probe_now(note)
        await asyncio.to_thread(cluster.start_node, node)
        note(f"broker {node} restarted (exit {code}) in {time.monotonic() - began:.1f} s")
        await asyncio.to_thread(backend.wait_in_sync, note)


async def freeze_a_broker(backend: ClusterFaults, note: Note) -> None:
    cluster = backend.cluster
    frozen = await asyncio.to_thread(backend.leader_of_commands)
    cluster.freeze_node(frozen)
    note(f"SIGSTOP broker {frozen}, leader of commands partition 0, for {FROZEN_S:.0f} s")
    backend.probe_now(note)
    try:
        await asyncio.sleep(FROZEN_S)
    finally:
        cluster.thaw_node(frozen)
    note(f"SIGCONT broker {frozen}")
    await asyncio.to_thread(backend.wait_in_sync, note)


async def restart_the_cluster(backend: ClusterFaults, note: Note) -> None:
    cluster = backend.cluster
    began = time.monotonic()
    await asyncio.gather(
        *(asyncio.to_thread(cluster.stop_node, node) for node in range(cluster.nodes))
    )
    note(f"every broker stopped in {time.monotonic() - began:.1f} s; down 3 s")
    await asyncio.sleep(3)
    for node in range(cluster.nodes):
        cluster.start_node(node, wait=False)
    await asyncio.to_thread(cluster.wait_ready)
    note(f"the cluster serves again from its data, {time.monotonic() - began:.1f} s after")
    await asyncio.to_thread(backend.wait_in_sync, note)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class CutOff(ClusterFaults):
    """Worker w1 reaches the brokers only through one TCP proxy per broker: each node has
    a second listener advertised at its proxy's address, so every connection w1 makes
    (bootstrap, leaders, coordinator) goes through a proxy. The fault blackholes them."""

    def __init__(self, root: Path, cluster: ApacheCluster, proxies: list[TcpProxy]) -> None:
        self.proxies = proxies
        super().__init__(root, cluster, _cut_off)

    def _worker(self, name: str) -> Proc:
        worker = super()._worker(name)
        if name == "w1":
            direct, proxied = self.settings.bootstrap, ",".join(p.address for p in self.proxies)
            args = worker.args
            worker.args = lambda: [proxied if a == direct else a for a in args()]
        return worker


async def _cut_off(backend: ClusterFaults, note: Note) -> None:
    assert isinstance(backend, CutOff)
    for proxy in backend.proxies:
        proxy.blackhole()
    note(f"w1 cut off from every broker for {FROZEN_S:.0f} s; w2 goes on")
    backend.probe_now(note)
    try:
        # Long past the group's session timeout: w2 takes every partition over.
        await backend.owned(lambda o: set(o.values()) == {backend.workers[1].url}, "w2 to own all")
        await asyncio.sleep(FROZEN_S)
    finally:
        for proxy in backend.proxies:
            proxy.heal()
    note("w1 reaches the brokers again")


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[tuple[ApacheCluster, list[TcpProxy]]]:
    """Three nodes for every test of this module (starting three JVMs costs more CPU
    than most faults), each with a second listener (EXTERNAL) that advertises a TCP proxy:
    only the cut-off test sends a worker through the proxies."""
    externals = _free_ports(3)
    with ExitStack() as stack:
        proxies = [stack.enter_context(TcpProxy(port)) for port in externals]
        for proxy in proxies:
            proxy.start()

        def external(index: int, defaults: Mapping[str, str]) -> dict[str, str]:
            return {
                "listeners": f"{defaults['listeners']},EXTERNAL://127.0.0.1:{externals[index]}",
                "advertised.listeners": f"{defaults['advertised.listeners']},"
                f"EXTERNAL://{proxies[index].address}",
                "listener.security.protocol.map": (
                    f"{defaults['listener.security.protocol.map']},EXTERNAL:PLAINTEXT"
                ),
            }

        started = start_apache(3, overrides=external)
        stack.callback(discard, started)
        yield started, proxies


@pytest.fixture
def proxied_cluster(
    shared_cluster: tuple[ApacheCluster, list[TcpProxy]],
) -> Iterator[tuple[ApacheCluster, list[TcpProxy]]]:
    """The shared cluster whole again, whatever the test before did to it: every node
    thawed and running, serving metadata with all three brokers, every proxy healed."""
    cluster, proxies = shared_cluster
    for proxy in proxies:
        proxy.heal()
    for node in range(cluster.nodes):
        cluster.thaw_node(node)
        if not cluster.running(node):
            cluster.start_node(node, wait=False)
    cluster.wait_ready()
    yield cluster, proxies


@pytest.fixture
def cluster(proxied_cluster: tuple[ApacheCluster, list[TcpProxy]]) -> ApacheCluster:
    return proxied_cluster[0]


FAULTS = {
    "kill9-leader": kill9_a_leader,
    "rolling-restart": rolling_restart,
    "freeze-broker": freeze_a_broker,
    "cluster-restart": restart_the_cluster,
}


async def test_a_worker_cut_off_from_every_broker_while_another_goes_on(
    proxied_cluster: tuple[ApacheCluster, list[TcpProxy]], tmp_path: Path
) -> None:
    cluster, proxies = proxied_cluster
    backend = CutOff(tmp_path, cluster, proxies)
    await run_checker(backend, instances=20, kills=1, freeze_at=None)
    assert backend.recovered_s is not None
    print(f"broker fault cut-off: recovered in {backend.recovered_s:.1f} s")
    check_logs(backend)


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_the_workload_survives(fault: str, cluster: ApacheCluster, tmp_path: Path) -> None:
    backend = ClusterFaults(tmp_path, cluster, FAULTS[fault])
    await run_checker(backend, instances=20, kills=1, freeze_at=None)
    assert backend.recovered_s is not None
    print(f"broker fault {fault}: recovered in {backend.recovered_s:.1f} s")
    check_logs(backend)


def check_logs(backend: ClusterFaults) -> None:
    for worker in backend.workers:
        repeated = repeated_broker_failures(worker.log)
        assert not repeated, f"{worker.name} logged librdkafka failures again within a " + (
            "minute:\n" + "\n".join(repeated[:10])
        )


_FAIL_LINE = re.compile(r'^ts=(\S+) .*msg="FAIL \[([^\]]*)\] \[thrd:([^\]]*)\]')


def repeated_broker_failures(log: Path) -> list[str]:
    """librdkafka's lines about failing to reach a broker that one worker process logged
    again for the same client and broker within a minute: while brokers are down, each
    client would log one at every reconnect (a thousand per worker in a cluster restart)."""
    repeated = []
    for run in log.read_text().split("---- start ")[1:]:  # one section per worker process
        last: dict[tuple[str, str], datetime] = {}
        for line in run.splitlines():
            found = _FAIL_LINE.match(line)
            if found is None:
                continue
            at, key = datetime.fromisoformat(found[1]), (found[2], found[3])
            if key in last and (at - last[key]).total_seconds() < 59:
                repeated.append(line)
            last[key] = at
    return repeated
