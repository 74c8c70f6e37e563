"""One Apache Kafka node for a whole ``pytest -n N`` run, shared by every xdist worker.

Each worker used to start a broker of its own: N JVMs, each paying its start, its JIT
warm-up and its idle work for the whole run, on a machine the suite keeps busy. Kafka
tests never needed that isolation: each runs on a topic prefix and a group of its own.

The first worker to need the broker starts it under a file lock in the run's shared
temporary directory and writes what the others read (its bootstrap list, the nodes' pids
and its data directory) to ``kafka.json``; a start that fails is written there too, so
every Kafka test on every worker fails with the same reason instead of trying again.
The broker belongs to the run, not to the worker that happened to start it (a worker
exits as soon as it has no more tests, while others still use the broker): the
controller kills it in ``pytest_sessionfinish`` (``stop_shared``). A run that never gets
there (cancelled, killed) would leave the JVM running in its own session, so a small
watchdog process kills it once the controller is gone.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from stepstream.ops.brokers import BrokerError
from stepstream.ops.brokers.apache import ApacheCluster, start_apache

STATE = "kafka.json"

# The worker that started the broker keeps its nodes' Popen objects (and its watchdog's)
# for its whole life: collected, each would warn that its process still runs (and pytest
# makes that an error).
_STARTED: list[ApacheCluster | subprocess.Popen[bytes]] = []

# Run as ``python -c WATCHDOG CONTROLLER_PID DATA PID...``: waits while the controller
# lives and a node runs; once the controller is gone, kills the nodes, removes the data.
WATCHDOG = """
import os, shutil, signal, sys, time
controller, data, *nodes = sys.argv[1:]
def alive(pid):
    try:
        os.kill(int(pid), 0)
        return True
    except ProcessLookupError:
        return False
while alive(controller):
    if not any(alive(pid) for pid in nodes):
        sys.exit(0)
    time.sleep(2)
for pid in nodes:
    try:
        os.killpg(int(pid), signal.SIGKILL)
    except ProcessLookupError:
        pass
shutil.rmtree(data, ignore_errors=True)
"""


@dataclass(frozen=True)
class SharedBroker:
    """The run's broker as a test sees it (``tests.kafka_broker.Broker``)."""

    bootstrap: str

    def stop(self) -> None:
        raise RuntimeError("the shared broker is stopped by the controller, not by a test")


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    with open(root / "kafka.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def shared_broker(root: Path) -> SharedBroker:
    """The run's broker, started by the first caller; raises ``BrokerError`` (with the
    nodes' log tails) on every call if it could not start."""
    state = root / STATE
    with _locked(root):
        if not state.exists():
            try:
                # A directory of this worker's: a start that died half-way elsewhere
                # cannot hold its lock.
                cluster = start_apache(1, data=root / f"kafka-{os.getpid()}")
            except Exception as exc:  # any failure: every Kafka test says it, none retries
                state.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
                raise
            atexit.unregister(cluster.stop)  # outlives this worker: see the docstring
            _STARTED.append(cluster)
            watchdog = [sys.executable, "-c", WATCHDOG, str(os.getppid()), str(cluster.data)]
            _STARTED.append(
                subprocess.Popen(
                    [*watchdog, *map(str, cluster.pids)],
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            started = {"bootstrap": cluster.bootstrap, "pids": cluster.pids}
            state.write_text(json.dumps({**started, "data": str(cluster.data)}))
        found = json.loads(state.read_text())
    if "error" in found:
        raise BrokerError(f"the run's shared broker did not start:\n{found['error']}")
    return SharedBroker(found["bootstrap"])


def stop_shared(root: Path) -> None:
    """Kill the run's broker, if a worker started one, and remove its data."""
    state = root / STATE
    if not state.exists():
        return
    found = json.loads(state.read_text())
    for pid in found.get("pids", ()):
        try:
            os.killpg(pid, signal.SIGKILL)  # its own session: group id == pid
        except ProcessLookupError:
            pass
    if "data" in found:
        shutil.rmtree(found["data"], ignore_errors=True)
    state.unlink()
