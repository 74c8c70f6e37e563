"""A flaky network between a Kafka worker and the broker.

The broker here advertises a TCP proxy (``tests.tcp_proxy``) as its address, so every
connection the worker (and the test's client) makes goes through it. While workflows run
the proxy first slows every packet down, then stalls all traffic for longer than the
group's session timeout (the broker expels the worker; its commits hang), then lets it
flow and, once the worker is busy again, cuts every connection. The worker must come
back by itself: every workflow completes with its result, no step succeeds twice, each
history is gap-free, and no attempt goes beyond its retry policy.

The time from the proxy healing (and from the cut) to the next step that completes is
printed: docs/kafka-notes.md quotes it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stepstream.consumers.kafka import create_topics
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.reads.views import HistoryEntry, InstanceStatus
from stepstream.engine.wire.topics import MEMBERS, TopicNames
from stepstream.ops.brokers.dev import Broker, _free_port, _resolve_bin
from stepstream.producers.client import Client
from stepstream.producers.kafka import aiokafka_options
from stepstream.producers.kafka.members import MembersView
from tests.conftest import KAFKA_TEST_OPTIONS, kafka_url
from tests.processes import launch, repo_env, worker_command
from tests.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 2
INSTANCES = 10
STEPS = 120
STEP_S = 0.1


def start_broker_behind(proxy: TcpProxy, timeout: float = 30.0) -> Broker:
    """Tansu listening on a free port but advertising ``proxy``'s address, so clients
    that bootstrap anywhere talk to it only through the proxy (which is pointed at it)."""
    from confluent_kafka.admin import AdminClient

    port = _free_port()
    workdir = Path(tempfile.mkdtemp(prefix="stepstream-tansu-proxied-"))
    with open(workdir / "tansu.log", "wb") as log:
        proc = subprocess.Popen(
            [
                _resolve_bin(),
                "broker",
                "--listener-url",
                f"tcp://127.0.0.1:{port}",
                "--advertised-listener-url",
                f"tcp://{proxy.address}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env={**os.environ, "NO_COLOR": "1"},
            start_new_session=True,
        )
    broker = Broker(proc, port, workdir)
    proxy.target_port = port
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            tail = broker.log_tail()
            broker.stop()
            raise RuntimeError(f"Tansu exited with {proc.returncode}:\n{tail}")
        try:
            AdminClient({"bootstrap.servers": proxy.address}).list_topics(timeout=2)
            return broker
        except Exception as exc:
            if time.monotonic() > deadline:
                tail = broker.log_tail()
                broker.stop()
                raise RuntimeError(f"Tansu behind the proxy never served: {exc}\n{tail}") from exc
        time.sleep(0.1)


@contextmanager
def broker_behind_proxy() -> Iterator[TcpProxy]:
    """A broker of its own that clients reach only through a TCP proxy."""
    proxy = TcpProxy()
    proxy.start()
    broker = start_broker_behind(proxy)
    try:
        yield proxy
    finally:
        proxy.stop()
        broker.stop()


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    with broker_behind_proxy() as proxy:
        yield proxy


class Worker:
    """A `stepstream worker` subprocess, stopped by pid."""

    def __init__(self, settings: KafkaSettings, state_dir: Path, log: Path) -> None:
        self.settings = settings
        self.state_dir = state_dir
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        command = worker_command(
            "tests.fault_workflows",
            self.settings.bootstrap,
            self.settings.prefix,
            self.state_dir,
            KAFKA_TEST_OPTIONS,
        )
        self.proc, self.url = launch(command, env=repo_env(), log=self.log)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


async def owns_everything(settings: KafkaSettings, url: str, timeout: float = 30) -> None:
    """Wait until ``<prefix>.members`` says the worker at ``url`` owns every partition."""
    view = await MembersView.open(
        TopicNames(settings.prefix).name(MEMBERS),
        timeout=10,
        **aiokafka_options(settings, "consumer"),
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            owners = {p: m.url for p in range(PARTITIONS) if (m := view.owner(p)) is not None}
            if len(owners) == PARTITIONS and set(owners.values()) == {url}:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"the worker never owned every partition: {owners}")
            await view.changed(remaining)
    finally:
        await view.close()


def steps_done(status: InstanceStatus) -> int:
    """How many of a ticker's steps are durable, from what it waits on now."""
    if status.finished:
        return STEPS
    done = 0
    for wait in status.waits:
        number = int(wait.key[1:])
        done = max(done, number if wait.key.startswith("t") else number + 1)
    return done


class Progress:
    """Polls the instances (reads go to the worker over HTTP, not through the proxy)
    and notes when the count of completed steps last grew."""

    def __init__(self, client: Client, ids: list[str]) -> None:
        self._client = client
        self._ids = ids
        self.done = 0
        self.grew_at = 0.0
        self.read_errors = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Progress:
        self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _poll(self) -> None:
        while True:
            counts: dict[str, int] = {}
            for instance in self._ids:
                try:
                    counts[instance] = steps_done(await self._client.status(instance))
                except Exception:
                    self.read_errors += 1
            total = sum(counts.values())
            if len(counts) == len(self._ids) and total > self.done:
                self.done = total
                self.grew_at = time.monotonic()
            await asyncio.sleep(0.02)

    async def grows_after(self, since: float, timeout: float) -> float:
        """Seconds from ``since`` until the count grew after it."""
        deadline = time.monotonic() + timeout
        while self.grew_at <= since:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no step completed within {timeout} s (done: {self.done}, "
                    f"read errors: {self.read_errors})"
                )
            await asyncio.sleep(0.01)
        return self.grew_at - since


def check_history(instance: str, history: list[HistoryEntry]) -> None:
    why = f"{instance}: " + ", ".join(
        f"{h.seq}:{h.type}:{h.attributes.get('key')}" for h in history
    )
    assert [h.seq for h in history] == list(range(1, len(history) + 1)), why
    successes = Counter(h.attributes["key"] for h in history if h.type == "StepSucceeded")
    assert successes == Counter(f"t{n}" for n in range(STEPS)), why
    for h in history:
        if h.type == "StepAttemptStarted":
            assert h.attributes["attempt"] <= h.attributes["max_attempts"], why
    assert [h.type for h in history].count("WorkflowCompleted") == 1, why


async def test_worker_rides_out_delay_blackholes_and_cut_connections(
    proxy: TcpProxy, tmp_path: Path
) -> None:
    settings = KafkaSettings.load(
        proxy.address, f"net{uuid.uuid4().hex[:8]}", options=KAFKA_TEST_OPTIONS, environ={}
    )
    await asyncio.to_thread(create_topics, settings, PARTITIONS)
    log = tmp_path / "worker.log"
    worker = Worker(settings, tmp_path / "a", log)
    ids = [f"tick-{i:02d}" for i in range(INSTANCES)]
    try:
        await asyncio.to_thread(worker.start)
        await owns_everything(settings, worker.url)
        async with Client.connect(kafka_url(settings)) as client:
            await asyncio.gather(
                *(
                    client.start("ticker", {"steps": STEPS, "seconds": STEP_S}, instance_id=i)
                    for i in ids
                )
            )
            async with Progress(client, ids) as progress:
                await progress.grows_after(time.monotonic(), 30)

                # Slow: every packet 150 ms late each way. Steps still complete.
                proxy.delay(0.15)
                slowed = time.monotonic()
                await asyncio.sleep(3)
                assert progress.grew_at > slowed, "no step completed while the network was slow"

                # A partition longer than the session timeout, bytes held back (TCP keeps
                # retrying): the broker expels the worker; its produces and heartbeats
                # hang, then arrive late.
                proxy.blackhole()
                await asyncio.sleep(8)
                assert worker.alive, log.read_text()[-3000:]
                proxy.heal()
                healed = time.monotonic()
                after_stall = await progress.grows_after(healed, 60)

                # A partition that loses what is sent meanwhile (requests and their
                # acknowledgements): its connections are broken when it heals.
                await asyncio.sleep(2)
                proxy.blackhole(drop=True)
                await asyncio.sleep(5)
                proxy.heal()
                healed = time.monotonic()
                after_drop = await progress.grows_after(healed, 60)

                # Busy again: cut every connection.
                await asyncio.sleep(2)
                cut = proxy.cut()
                cut_at = time.monotonic()
                after_cut = await progress.grows_after(cut_at, 60)
                print(
                    f"next step completed {after_stall:.2f} s after an 8 s stall healed, "
                    f"{after_drop:.2f} s after a 5 s dropping blackhole healed, "
                    f"{after_cut:.2f} s after {cut} connections were cut"
                )

            results = await asyncio.gather(*(client.result(i, timeout=120) for i in ids))
            assert results == [{"id": i, "ticks": STEPS} for i in ids]
            seen = {i: await client.history(i) for i in ids}
            for instance, history in seen.items():
                check_history(instance, history)
        assert worker.alive, log.read_text()[-3000:]

        # The history topic itself holds exactly that: a worker without local state
        # rebuilds every instance from it and reads the same histories.
        await asyncio.to_thread(worker.stop)
        fresh = Worker(settings, tmp_path / "b", log)
        worker = fresh
        await asyncio.to_thread(fresh.start)
        await owns_everything(settings, fresh.url)
        async with Client.connect(kafka_url(settings)) as client:
            for instance, history in seen.items():
                rebuilt = await client.history(instance)
                assert [(h.seq, h.type, h.attributes) for h in rebuilt] == [
                    (h.seq, h.type, h.attributes) for h in history
                ], instance
    finally:
        worker.stop()
        print(f"worker log:\n{log.read_text()[-6000:]}")
