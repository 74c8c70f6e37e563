"""Crash checker: a seeded random workload under repeated kill -9, on each backend.

The engine runs as real processes (`stepstream dev` on one data directory; two
`stepstream worker` processes in one consumer group on Kafka), running the plans of
``tests.crash_workflows``: steps whose bodies fail their first attempts on purpose and
retry, parallel steps, sleeps, waits with and without timeouts, a wait that never ends.
While one client per instance sends events (each with a unique id), pauses and resumes
and now and then cancels, the engine is killed with SIGKILL at random moments and
started again (on Kafka, on its old state directory or an empty one). On Kafka one worker
is also frozen with SIGSTOP until the other owns all partitions, then let go with
SIGCONT: what it writes then must not be accepted by any reader.

The client records every call and whether it was acknowledged (the client does not see
command ids: events carry a unique id, cancels a unique reason). After a last phase that
resumes what is paused and satisfies what still waits, the checker
(``tests.crash_check``) reads the raw history log (the embedded log directly, the Kafka
topic with a plain consumer) and on Kafka the commands topic too (the embedded log drops
consumed commands), folds the history by the reader rules of schemas/README.md and
asserts the guarantees of design.md for every instance: each command (acknowledged or
not) applied exactly once, each acknowledged one applied, every command on the Kafka
commands topic applied, events claimed once and in order, contiguous seqs, no step
success twice, attempts within the retry policy (bodies counted in a ledger: each run
belongs to an accepted attempt), sleeps and timeouts never early, nothing driven by code
while paused, the expected end (completed, cancelled, or waiting for an event that never
comes), the result consistent with the history, and the engine serving the history the
log holds. The last tests check that the checker finds faults injected into a story.

``STEPSTREAM_CRASH_SEED=N`` replays a seed (the plans and the sequence of decisions; the
timing of kills is the machine's). A failure prints the seed and, per instance, the
problems, the folded story, the commands, the client's calls and the step ledger.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition

from stepstream.consumers.embedded import EmbeddedDB
from stepstream.consumers.kafka import create_topics
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.errors import (
    ConnectionFailed,
    InstanceFinished,
    InstanceNotPaused,
    ResultTimeout,
    StepstreamError,
)
from stepstream.engine.wire.records import (
    CancelWorkflow,
    CommandIgnored,
    EventBuffered,
    HistoryRecord,
    PartitionFenced,
    Payload,
    Record,
    SendEvent,
    SleepElapsed,
    SleepStarted,
    SnapshotTaken,
    StartWorkflow,
    StepAttemptStarted,
    StepFailedRecord,
    StepSucceeded,
    TimerFired,
    WaitSatisfied,
    WaitStarted,
    WorkflowCompleted,
    WorkflowPaused,
    WorkflowStarted,
)
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import (
    COMMANDS,
    DEAD_LETTERS,
    HISTORY,
    MEMBERS,
    SNAPSHOTS,
    TopicNames,
)
from stepstream.producers.client import Client
from stepstream.producers.kafka import aiokafka_options
from stepstream.producers.kafka.members import MembersView
from tests.conftest import KAFKA_TEST_OPTIONS, kafka_settings, kafka_url
from tests.crash_check import Logged, Run, Sent, check_run, fold, render_instance
from tests.crash_workflows import LEDGER_ENV, read_ledger
from tests.kafka_broker import Broker

REPO = Path(__file__).resolve().parents[2]
SEED_ENV = "STEPSTREAM_CRASH_SEED"
EXPECTED_ERRORS = (ConnectionFailed, InstanceFinished, InstanceNotPaused, ResultTimeout)
EVENT_NAMES = ("a", "b")
SETTLE_TIMEOUT_S = 60.0


def _seed() -> int:
    raw = os.environ.get(SEED_ENV)
    return int(raw) if raw else random.randrange(1 << 31)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# ---- the plans ------------------------------------------------------------------------


def _step_op(rng: random.Random, key: str) -> dict[str, Any]:
    maximum = rng.randint(1, 4)
    # Mostly succeeds after some failed attempts; sometimes uses up every attempt.
    fail = rng.randint(0, maximum) if rng.random() < 0.25 else rng.randint(0, maximum - 1)
    seconds = rng.choice([0.0, rng.uniform(0.02, 0.15), rng.uniform(0.15, 0.5)])
    if rng.random() < 0.1:
        seconds = rng.uniform(0.5, 1.2)  # long enough to be killed or frozen in
    return {
        "op": "step",
        "key": key,
        "max": maximum,
        "fail": fail,
        "seconds": round(seconds, 3),
        "async": rng.random() < 0.5,
    }


def make_plan(rng: random.Random) -> dict[str, Any]:
    ops: list[dict[str, Any]] = []
    for i in range(rng.randint(3, 7)):
        roll = rng.random()
        if roll < 0.35:
            ops.append(_step_op(rng, f"s{i}"))
        elif roll < 0.5:
            steps = [_step_op(rng, f"g{i}-{j}") for j in range(rng.randint(2, 3))]
            ops.append({"op": "gather", "steps": steps})
        elif roll < 0.7:
            ops.append({"op": "sleep", "key": f"z{i}", "seconds": round(rng.uniform(0.1, 2.5), 3)})
        else:
            timeout = None if rng.random() < 0.6 else round(rng.uniform(0.3, 3.0), 3)
            ops.append(
                {"op": "wait", "key": f"w{i}", "event": rng.choice(EVENT_NAMES), "timeout": timeout}
            )
    if rng.random() < 0.15:
        ops.append({"op": "wait", "key": "forever", "event": "never", "timeout": None})
    return {"ops": ops}


# ---- engine processes -------------------------------------------------------------------


class Proc:
    """One engine process at a time under one name; started, killed and stopped by pid."""

    def __init__(self, name: str, root: Path, args: Callable[[], list[str]], env: dict[str, str]):
        self.name = name
        self.root = root
        self.args = args
        self.env = env
        self.log = root / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.starts = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def start(self) -> None:
        assert not self.alive(), f"{self.name} is running"
        self.starts += 1
        out = self.root / f"{self.name}-{self.starts}.out"
        with open(self.log, "ab") as log, open(out, "wb") as stdout:
            log.write(f"---- start {self.starts} ----\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "stepstream.ops.cli", *self.args()],
                cwd=REPO,
                env=self.env,
                stdout=stdout,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 30
        while "listening on " not in out.read_text():
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.kill9()
                pytest.fail(f"{self.name} did not start within 30 s:\n{self.tail()}")
            await asyncio.sleep(0.02)
        self.url = out.read_text().split("listening on ", 1)[1].split()[0]

    def kill9(self) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def signal(self, sig: int) -> None:
        assert self.alive(), f"{self.name} is not running"
        os.kill(self.pid, sig)

    def stop(self) -> None:
        """SIGTERM, and SIGKILL if it does not exit within 30 s (then fails)."""
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)  # in case it is frozen
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise AssertionError(f"{self.name} ignored SIGTERM:\n{self.tail()}") from None

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def _env(ledger: Path, **extra: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), path) if p),
        LEDGER_ENV: str(ledger),
        # Bodies take at most half a second: hand-overs need not wait 10 s.
        "STEPSTREAM_DRAIN_TIMEOUT_S": "2",
        **extra,
    }


@dataclass(frozen=True)
class Frozen:
    """A worker frozen with SIGSTOP while the other took its partitions over."""

    pid: int
    partitions: list[int]
    epoch: int  # the highest epoch it owned them with (its members record)
    stopped_ms: int
    thawed_ms: int

    def report(
        self, history: list[Logged], ledger: dict[str, list[Any]]
    ) -> tuple[list[str], list[str]]:
        """Problems with the take-over, and what the thawed worker wrote and ran."""
        problems: list[str] = []
        lines: list[str] = []
        for partition in self.partitions:
            records = sorted(
                (x for x in history if x.partition == partition), key=lambda x: x.offset
            )
            takeover = next(
                (
                    x
                    for x in records
                    if isinstance(x.record, PartitionFenced)
                    and self.stopped_ms <= x.record.time_ms <= self.thawed_ms
                ),
                None,
            )
            if takeover is None:
                problems.append(f"partition {partition}: no fence while its owner was frozen")
                continue
            if takeover.record.epoch <= self.epoch:
                problems.append(
                    f"partition {partition}: the take-over fence has epoch "
                    f"{takeover.record.epoch}, not above the frozen owner's {self.epoch}"
                )
            late = [
                x for x in records if x.offset > takeover.offset and x.record.epoch <= self.epoch
            ]
            lines.append(
                f"partition {partition}: fenced at offset {takeover.offset} with epoch "
                f"{takeover.record.epoch} (frozen owner's {self.epoch}); the frozen owner wrote "
                f"{len(late)} records after it, all of a lower epoch, skipped by readers: "
                f"{[(x.record.type, x.record.instance_id, x.record.seq) for x in late]}"
            )
        bodies = sum(
            1
            for lines_ in ledger.values()
            for _, _, pid, what, at in lines_
            if pid == self.pid and what == "start" and at * 1000 >= self.thawed_ms
        )
        lines.append(
            f"the thawed worker started {bodies} step bodies after SIGCONT (before it learnt "
            "it was fenced, or once it owned partitions again): each of an attempt the "
            "log accepts, none run twice (checked with the other bodies)"
        )
        return problems, lines


class Backend:
    """What the workload needs of a backend's processes."""

    name = ""
    # The run's workload, set by run_checker: a fault may add probe instances to it.
    workload: Workload | None = None
    partitions = 2
    summary = ""  # what else the backend has to say in the one-line summary
    root: Path
    ledger: Path

    def client(self) -> Any:
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def kill_and_restart(self, rng: random.Random, note: Callable[[str], None]) -> None:
        raise NotImplementedError

    async def freeze(self, rng: random.Random, note: Callable[[str], None]) -> None:
        """Kafka only: SIGSTOP a worker until the other owns its partitions, then SIGCONT."""

    def stop(self) -> None:
        raise NotImplementedError

    async def read_logs(self) -> tuple[list[Logged], list[Logged] | None, int]:
        """(history, commands if the log keeps them all, number of dead letters), read
        after ``stop``."""
        raise NotImplementedError

    def tails(self) -> str:
        raise NotImplementedError


class Embedded(Backend):
    name = "embedded"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.ledger = root / "ledger"
        self.ledger.mkdir()
        port = _free_port()
        self.dev = Proc(
            "dev",
            root,
            lambda: [
                "dev",
                "--workflows",
                "tests.crash_workflows",
                "--data",
                str(self.data),
                "--port",
                str(port),
                "--partitions",
                str(self.partitions),
                "--log-level",
                "WARNING",
            ],
            _env(self.ledger),
        )
        self.url = f"http://127.0.0.1:{port}"

    def client(self) -> Any:
        return Client.connect(self.url, timeout=15)

    async def start(self) -> None:
        await self.dev.start()

    async def kill_and_restart(self, rng: random.Random, note: Callable[[str], None]) -> None:
        self.dev.kill9()
        down = rng.uniform(0, 0.5)
        note(f"kill -9 dev, down {down:.2f} s")
        await asyncio.sleep(down)
        await self.dev.start()

    def stop(self) -> None:
        self.dev.stop()

    async def read_logs(self) -> tuple[list[Logged], list[Logged] | None, int]:
        # The embedded log drops consumed commands at each housekeeping sweep (one runs
        # at every start): the checker reads which commands were applied from history.
        serde = default_serde()
        db = await EmbeddedDB.open(str(self.data))
        try:
            history = [
                Logged(partition, entry.offset, serde.decode(entry.value))
                for partition in range(db.partitions)
                for entry in db.log.read(HISTORY, partition, 0, 10_000_000)
            ]
            dead = sum(len(db.log.read(DEAD_LETTERS, p, 0, 1000)) for p in range(db.partitions))
            return history, None, dead
        finally:
            await db.close()

    def tails(self) -> str:
        return f"dev log:\n{self.dev.tail()}"


class Kafka(Backend):
    name = "kafka"
    partitions = 4
    replication = 1  # three in tests/faults/test_broker_faults.py, on a three-node cluster

    def __init__(self, root: Path, broker: Broker) -> None:
        self.root = root
        self.ledger = root / "ledger"
        self.ledger.mkdir()
        self.settings: KafkaSettings = kafka_settings(broker)
        self.state_dirs = {name: root / f"{name}-state-1" for name in ("w1", "w2")}
        self.workers = [self._worker(name) for name in self.state_dirs]
        self.view: MembersView | None = None
        self.frozen: Frozen | None = None

    def _worker(self, name: str) -> Proc:
        def args() -> list[str]:
            out = [
                "worker",
                "--workflows",
                "tests.crash_workflows",
                "--bootstrap",
                self.settings.bootstrap,
                "--prefix",
                self.settings.prefix,
                "--state-dir",
                str(self.state_dirs[name]),
                "--port",
                "0",
                "--log-level",
                "WARNING",
            ]
            for option in KAFKA_TEST_OPTIONS:
                out += ["--kafka-opt", option]
            return out

        return Proc(name, self.root, args, _env(self.ledger, STEPSTREAM_SNAPSHOT_EVERY="60"))

    def client(self) -> Any:
        return Client.connect(kafka_url(self.settings), timeout=15, command_timeout=8)

    async def start(self) -> None:
        await asyncio.to_thread(
            create_topics, self.settings, self.partitions, replication=self.replication
        )
        self.view = await MembersView.open(
            TopicNames(self.settings.prefix).name(MEMBERS),
            timeout=10,
            **aiokafka_options(self.settings, "consumer"),
        )
        for worker in self.workers:
            await worker.start()
        await self.owned(lambda o: len(set(o.values())) == 2, "both workers to own partitions")

    async def owned(self, expect: Callable[[dict[int, str]], bool], what: str) -> dict[int, str]:
        assert self.view is not None
        deadline = time.monotonic() + 30
        while True:
            owners = {
                p: m.url for p in range(self.partitions) if (m := self.view.owner(p)) is not None
            }
            if len(owners) == self.partitions and expect(owners):
                return owners
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: owners {owners}")
            await self.view.changed(0.5)

    async def _revive(self, note: Callable[[str], None]) -> None:
        for worker in self.workers:
            if not worker.alive():
                code = worker.proc.returncode if worker.proc is not None else None
                note(f"{worker.name} had exited by itself (code {code}); started again")
                await worker.start()

    async def kill_and_restart(self, rng: random.Random, note: Callable[[str], None]) -> None:
        await self._revive(note)
        # Now and then both at once: every partition restores.
        victims = self.workers if rng.random() < 0.2 else [rng.choice(self.workers)]
        for worker in victims:
            worker.kill9()
        down = rng.uniform(0, 1.5)
        for worker in victims:
            fresh = rng.random() < 0.35
            if fresh:
                self.state_dirs[worker.name] = (
                    self.root / f"{worker.name}-state-{worker.starts + 1}"
                )
            state = "empty" if fresh else "same"
            note(f"kill -9 {worker.name}, down {down:.2f} s, {state} state")
        await asyncio.sleep(down)
        await asyncio.gather(*(worker.start() for worker in victims))

    def running_bodies(self) -> Counter[int]:
        """Step bodies that have started and not ended, by pid (from the ledger)."""
        running: dict[tuple[str, str, int], int] = {}
        for path in self.ledger.iterdir():
            for key, attempt, pid, what, _ in read_ledger(self.ledger, path.name):
                if what == "start":
                    running[(path.name, key, attempt)] = pid
                else:
                    running.pop((path.name, key, attempt), None)
        return Counter(running.values())

    async def freeze(self, rng: random.Random, note: Callable[[str], None]) -> None:
        await self._revive(note)
        await self.owned(lambda o: len(set(o.values())) == 2, "both workers to own partitions")
        # Freeze a worker while step bodies run there, if that happens within 5 s.
        deadline = time.monotonic() + 5
        while True:
            running = self.running_bodies()
            busy = [w for w in self.workers if running[w.pid]]
            if busy or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        assert self.view is not None
        # Only a worker that owns partitions in the view taken here can be frozen out of
        # them. The view may have moved since both owned some: a partition changing hands
        # is claimed by neither worker for a moment (cooperative rebalancing), so wait
        # for a view in which someone owns something.
        while True:
            owned = {p: m for p in range(self.partitions) if (m := self.view.owner(p)) is not None}
            owners = {m.url for m in owned.values()}
            candidates = [w for w in busy if w.url in owners] or [
                w for w in self.workers if w.url in owners
            ]
            if candidates:
                break
            await self.view.changed(1.0)
        frozen = rng.choice(candidates)
        other = next(w for w in self.workers if w is not frozen)
        frozen.signal(signal.SIGSTOP)
        started = time.monotonic()
        stopped_ms = int(time.time() * 1000)
        try:
            await self.owned(lambda o: set(o.values()) == {other.url}, f"{other.name} to own all")
            # Let the new owner write on top of its fences for a moment.
            await asyncio.sleep(rng.uniform(0.2, 1.0))
        finally:
            frozen.signal(signal.SIGCONT)
        self.frozen = Frozen(
            frozen.pid,
            [p for p, m in owned.items() if m.url == frozen.url],
            max(m.epoch for m in owned.values() if m.url == frozen.url),
            stopped_ms,
            int(time.time() * 1000),
        )
        note(
            f"SIGSTOP {frozen.name} (pid {frozen.pid}, {running[frozen.pid]} step bodies "
            f"running) for {time.monotonic() - started:.1f} s, until {other.name} owned all "
            "partitions; SIGCONT"
        )

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()

    async def close(self) -> None:
        if self.view is not None:
            await self.view.close()

    async def read_logs(self) -> tuple[list[Logged], list[Logged] | None, int]:
        history, commands, dead, snapshots = await asyncio.gather(
            asyncio.to_thread(self._read, HISTORY),
            asyncio.to_thread(self._read, COMMANDS),
            asyncio.to_thread(self._read, DEAD_LETTERS),
            asyncio.to_thread(self._read, SNAPSHOTS),
        )
        taken = sum(1 for x in snapshots if isinstance(x.record, SnapshotTaken))
        self.summary = f", {taken} snapshots taken"
        return history, commands, len(dead)

    def _read(self, kind: str) -> list[Logged]:
        """Every record of ``<prefix>.<kind>`` with a plain consumer, to the end."""
        serde = default_serde()
        topic = TopicNames(self.settings.prefix).name(kind)
        consumer = Consumer(
            {
                "bootstrap.servers": self.settings.bootstrap,
                "group.id": f"crash-reader-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "fetch.wait.max.ms": 5,
            }
        )
        try:
            consumer.assign([TopicPartition(topic, p, 0) for p in range(self.partitions)])
            open_partitions, out = set(range(self.partitions)), []
            while open_partitions:
                msg = consumer.poll(10)
                assert msg is not None, f"reading {topic} stalled"
                err = msg.error()
                if err is not None:
                    assert err.code() == KafkaError._PARTITION_EOF, err.str()
                    open_partitions.discard(msg.partition() or 0)
                    continue
                value = msg.value() or b""
                out.append(Logged(msg.partition() or 0, msg.offset() or 0, serde.decode(value)))
            return out
        finally:
            consumer.close()

    def tails(self) -> str:
        return "\n".join(f"{w.name} log:\n{w.tail()}" for w in self.workers)


# ---- the workload -----------------------------------------------------------------------


class Workload:
    def __init__(self, backend: Backend, seed: int, instances: int) -> None:
        self.backend = backend
        self.seed = seed
        rng = random.Random(seed)
        self.plans = {f"c{seed % 1000:03d}-{i:02d}": make_plan(rng) for i in range(instances)}
        self.cancellable = {i for i in self.plans if rng.random() < 0.12}
        self.sent: list[Sent] = []
        self.unexpected: list[str] = []
        self.notes: list[str] = []
        self.t0 = time.monotonic()
        self.chaos = True
        self._eids = 0

    def note(self, what: str) -> None:
        line = f"{time.monotonic() - self.t0:7.2f} s  {what}"
        self.notes.append(line)

    def eid(self, instance: str) -> str:
        self._eids += 1
        return f"{instance}/e{self._eids}"

    async def call(
        self,
        kind: str,
        instance: str,
        action: Awaitable[Any],
        *,
        ident: str = "",
        name: str = "",
    ) -> str | None:
        """Run one client call; record it. Returns None when acknowledged, else the
        error's type name."""
        at = time.monotonic() - self.t0
        at_ms = time.time_ns() // 1_000_000
        try:
            await action
        except EXPECTED_ERRORS as exc:
            self.sent.append(Sent(kind, instance, ident, name, False, f"{exc!r}", at, at_ms))
            return type(exc).__name__
        except Exception as exc:
            self.sent.append(Sent(kind, instance, ident, name, False, f"{exc!r}", at, at_ms))
            self.unexpected.append(f"{at:.2f} s {kind} {instance} {ident}: {exc!r}")
            return type(exc).__name__
        self.sent.append(Sent(kind, instance, ident, name, True, "", at, at_ms))
        return None

    async def start(self, client: Client, instance: str) -> None:
        """Until acknowledged: a start is idempotent on the instance id."""
        while True:
            action = client.start("crash-plan", self.plans[instance], instance_id=instance)
            if await self.call("start", instance, action) is None:
                return
            await asyncio.sleep(0.2)

    async def send(self, client: Client, instance: str, name: str) -> str | None:
        eid = self.eid(instance)
        payload = {"eid": eid, "name": name}
        return await self.call(
            "event", instance, client.send_event(instance, name, payload), ident=eid, name=name
        )

    async def pause_resume(self, client: Client, instance: str, rng: random.Random) -> str | None:
        error = await self.call("pause", instance, client.pause(instance))
        if error == "InstanceFinished":
            return error
        await asyncio.sleep(rng.uniform(0.05, 0.8))
        # Resume until it is known not to be paused: a pause that was not acknowledged
        # may have been applied all the same.
        for _ in range(50):
            error = await self.call("resume", instance, client.resume(instance))
            if error in (None, "InstanceNotPaused", "InstanceFinished"):
                break
            await asyncio.sleep(0.3)
        return error

    async def actor(self, client: Client, instance: str, spread: float) -> None:
        """One caller per instance, one call at a time: starts it at a random moment
        of the chaos, then sends events, pauses and resumes, perhaps cancels, until
        the chaos ends or the instance is found finished."""
        rng = random.Random(f"{self.seed}/{instance}")
        await asyncio.sleep(rng.uniform(0, spread))
        await self.start(client, instance)
        names = [op["event"] for op in self.plans[instance]["ops"] if op["op"] == "wait"]
        names = [n for n in names if n != "never"] or list(EVENT_NAMES)
        error: str | None = None
        while self.chaos and error != "InstanceFinished":
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            roll = rng.random()
            if roll < 0.6:
                name = "stray" if rng.random() < 0.05 else rng.choice(names)
                error = await self.send(client, instance, name)
            elif roll < 0.75:
                error = await self.pause_resume(client, instance, rng)
            elif roll < 0.8 and instance in self.cancellable:
                reason = f"cancel {instance}/{uuid.uuid4().hex[:8]}"
                action = client.cancel(instance, reason=reason)
                if await self.call("cancel", instance, action, ident=reason) is None:
                    return

    async def settle(self, client: Client) -> dict[str, Any]:
        """Resume what is paused and send what is waited for until every instance has
        finished or waits only for the event that never comes; returns the statuses."""
        final: dict[str, Any] = {}
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        statuses: dict[str, Any] = {}
        while len(final) < len(self.plans):
            if time.monotonic() > deadline:
                stuck = {i: statuses.get(i) for i in self.plans if i not in final}
                raise AssertionError(f"seed {self.seed}: instances never settled: {stuck}")
            statuses = {}
            for instance in self.plans:
                if instance in final:
                    continue
                try:
                    status = await client.status(instance)
                except StepstreamError as exc:
                    statuses[instance] = repr(exc)
                    continue
                statuses[instance] = status
                waits = [(w.kind, w.key) for w in status.waits]
                if status.finished or (
                    status.status == "running" and waits == [("wait", "forever")]
                ):
                    final[instance] = status
                elif status.status == "paused":
                    await self.call("resume", instance, client.resume(instance))
                else:
                    for wait in status.waits:
                        if wait.kind == "wait" and wait.event not in (None, "never"):
                            await self.send(client, instance, wait.event)
            await asyncio.sleep(0.25)
        return final


async def served_history(client: Client, instance: str) -> list[tuple[int, str, str]]:
    """The history the engine serves (asked again while an owner moves)."""
    for _ in range(3):
        try:
            return [(h.seq, h.type, h.command_id) for h in await client.history(instance)]
        except ConnectionFailed:
            await asyncio.sleep(1)
    return [(h.seq, h.type, h.command_id) for h in await client.history(instance)]


@asynccontextmanager
async def explained(workload: Workload, backend: Backend) -> AsyncIterator[None]:
    try:
        yield
    except BaseException:
        print(f"seed {workload.seed} ({backend.name}); what happened:")
        print("\n".join(workload.notes))
        print(backend.tails())
        raise


async def run_checker(backend: Backend, instances: int, kills: int, freeze_at: int | None) -> None:
    seed = _seed()
    print(f"\ncrash checker [{backend.name}] seed {seed}")
    began = time.monotonic()
    workload = Workload(backend, seed, instances)
    backend.workload = workload
    rng = random.Random(f"{seed}/kills")
    await backend.start()
    try:
        async with explained(workload, backend):
            async with backend.client() as client:

                async def chaos() -> None:
                    for n in range(kills):
                        # Now and then while the last restart still recovers.
                        await asyncio.sleep(
                            rng.uniform(0.05, 0.3) if rng.random() < 0.2 else rng.uniform(1.0, 3.0)
                        )
                        if n == freeze_at:
                            await backend.freeze(rng, workload.note)
                            # What the thawed worker does before it finds out.
                            await asyncio.sleep(rng.uniform(2.0, 4.0))
                        await backend.kill_and_restart(rng, workload.note)
                    await asyncio.sleep(rng.uniform(0.5, 1.5))
                    workload.chaos = False

                # Instances start while the kills go on (over about half of them).
                spread = kills * 1.0
                actors = [workload.actor(client, i, spread) for i in workload.plans]
                await asyncio.gather(chaos(), *actors)
                if isinstance(backend, Kafka):
                    await backend._revive(workload.note)
                workload.note("chaos over; settling")
                final = await workload.settle(client)
                served = {i: await served_history(client, i) for i in workload.plans}
            workload.note("settled; stopping")
            backend.stop()
            history, commands, dead = await backend.read_logs()
    finally:
        backend.stop()
        if isinstance(backend, Kafka):
            await backend.close()

    folded = fold(history, backend.partitions)
    run = Run(
        plans=workload.plans,
        folded=folded,
        commands=commands,
        sent=workload.sent,
        ledger={i: read_ledger(backend.ledger, i) for i in workload.plans},
        served=served,
        status={i: (s.status, [(w.kind, w.key) for w in s.waits]) for i, s in final.items()},
        dead_letters=dead,
    )
    verdict = check_run(run)
    for problem in workload.unexpected:
        verdict.add("(client)", f"unexpected error: {problem}")
    freeze_lines: list[str] = []
    if isinstance(backend, Kafka) and backend.frozen is not None:
        problems, freeze_lines = backend.frozen.report(history, run.ledger)
        for problem in problems:
            verdict.add("(freeze)", problem)

    acked = sum(1 for s in workload.sent if s.acked)
    ends: dict[str, int] = {}
    for status in final.values():
        key = status.status if status.finished else "waiting"
        ends[key] = ends.get(key, 0) + 1
    print(
        f"crash checker [{backend.name}] seed {seed}: N={instances} instances, "
        f"{kills} kills{' + 1 freeze' if freeze_at is not None else ''}, "
        f"{len(workload.sent)} commands ({acked} acknowledged), "
        f"{verdict.transitions} transitions checked, {verdict.body_runs} step bodies run, "
        f"{verdict.crossed} instances crossed a restart, {verdict.lost_attempts} attempts lost, "
        f"{len(folded.stale)} stale + {len(folded.redelivered)} re-delivered records skipped, "
        f"ends {ends}{backend.summary}, {time.monotonic() - began:.0f} s"
    )
    print("\n".join(workload.notes + freeze_lines))
    if verdict.problems:
        report = [f"seed {seed} ({backend.name}): {len(verdict.problems)} instances with problems"]
        for instance, problems in sorted(verdict.problems.items()):
            if instance.startswith("("):
                report.append(f"{instance}: " + "\n  ".join(problems))
            else:
                report.append(render_instance(run, instance, problems))
        text = "\n\n".join(report)
        print(text)
        pytest.fail(text[:20_000], pytrace=False)


@pytest.mark.slow
async def test_crash_checker_embedded(tmp_path: Path) -> None:
    await run_checker(Embedded(tmp_path), instances=40, kills=10, freeze_at=None)


@pytest.mark.slow
@pytest.mark.kafka
async def test_crash_checker_kafka(kafka_broker: Broker, tmp_path: Path) -> None:
    await run_checker(Kafka(tmp_path, kafka_broker), instances=30, kills=8, freeze_at=2)


# ---- the checker checks: a clean story passes, each injected fault is found -------------


def _json(value: Any) -> Payload:
    return Payload("application/json", json.dumps(value).encode())


def _clean_run() -> Run:
    """One instance, its story as the engine writes it, the calls that led to it."""
    plan = {
        "ops": [
            {"op": "step", "key": "s0", "max": 2, "fail": 1, "seconds": 0, "async": False},
            {"op": "wait", "key": "w1", "event": "a", "timeout": None},
            {"op": "sleep", "key": "z2", "seconds": 1.0},
        ]
    }
    i, t = "i-1", 1_000_000
    env = {"instance_id": i, "epoch": 7}
    story: list[HistoryRecord] = [
        WorkflowStarted(
            **env,
            seq=1,
            time_ms=t,
            command_id="c-start",
            workflow="crash-plan",
            version="1",
            input=_json(plan),
        ),
        StepAttemptStarted(
            **env, seq=2, time_ms=t, command_id="c-start", key="s0", attempt=1, max_attempts=2
        ),
        StepFailedRecord(
            **env,
            seq=3,
            time_ms=t + 5,
            command_id="step:s0:1",
            key="s0",
            attempt=1,
            error_type="RuntimeError",
            error_message="on purpose",
            next_attempt_at_ms=t + 55,
        ),
        StepAttemptStarted(
            **env, seq=4, time_ms=t + 60, command_id="fire:s0", key="s0", attempt=2, max_attempts=2
        ),
        StepSucceeded(
            **env,
            seq=5,
            time_ms=t + 61,
            command_id="step:s0:2",
            key="s0",
            attempt=2,
            result=_json({"key": "s0", "attempt": 2}),
        ),
        WaitStarted(**env, seq=6, time_ms=t + 61, command_id="step:s0:2", key="w1", event_name="a"),
        WaitSatisfied(
            **env,
            seq=7,
            time_ms=t + 90,
            command_id="c-ev",
            key="w1",
            event_name="a",
            payload=_json({"eid": "i-1/e1"}),
            event_command_id="c-ev",
        ),
        SleepStarted(
            **env, seq=8, time_ms=t + 90, command_id="c-ev", key="z2", wake_at_ms=t + 1090
        ),
        SleepElapsed(**env, seq=9, time_ms=t + 1095, command_id="fire:z2", key="z2"),
        WorkflowCompleted(
            **env,
            seq=10,
            time_ms=t + 1095,
            command_id="fire:z2",
            result=_json([{"key": "s0", "attempt": 2}, {"eid": "i-1/e1"}, "slept"]),
        ),
    ]
    ledger = [
        ("s0", 1, 1, "start", 0.0),
        ("s0", 1, 1, "fail", 0.0),
        ("s0", 2, 1, "start", 0.0),
        ("s0", 2, 1, "end", 0.0),
    ]
    sent = [Sent("start", i, acked=True), Sent("event", i, "i-1/e1", "a", acked=True)]
    return _completed_run(plan, story, sent, ledger)


def _completed_run(
    plan: dict[str, Any],
    story: list[HistoryRecord],
    sent: list[Sent],
    ledger: list[tuple[str, int, int, str, float]],
) -> Run:
    """One completed instance: its story on a partition fenced at epoch 7, as the
    checker reads it after a run."""
    i = story[0].instance_id
    fence = PartitionFenced(
        instance_id="", epoch=7, time_ms=story[0].time_ms, command_id="fence:7", partition=0
    )
    history = [Logged(0, 0, fence), *(Logged(0, n + 1, r) for n, r in enumerate(story))]
    return Run(
        plans={i: plan},
        folded=fold(history, 1),
        commands=None,
        sent=sent,
        ledger={i: ledger},
        served={i: [(r.seq, r.type, r.command_id) for r in story]},
        status={i: ("completed", [])},
        dead_letters=0,
    )


def _refold(run: Run, edit: Callable[[list[Logged]], list[Logged]]) -> Run:
    history = [
        Logged(0, 0, PartitionFenced(instance_id="", epoch=7, command_id="f", partition=0)),
        *(Logged(0, n + 1, r) for n, r in enumerate(run.folded.stories["i-1"])),
    ]
    run.folded = fold(edit(history), 1)
    return run


def _replace(history: list[Logged], seq: int, **changes: Any) -> list[Logged]:
    return [
        Logged(x.partition, x.offset, dataclasses.replace(x.record, **changes))
        if x.record.seq == seq and x.record.instance_id
        else x
        for x in history
    ]


def _append(history: list[Logged], record: Record) -> list[Logged]:
    return [*history, Logged(0, len(history), record)]


def _problems(run: Run) -> str:
    return " | ".join(p for ps in check_run(run).problems.values() for p in ps)


def test_the_checker_passes_a_clean_story_and_a_fenced_out_writer() -> None:
    assert _problems(_clean_run()) == ""
    # A fenced-out owner's late record (lower epoch, after a newer fence) is skipped.
    run = _refold(
        _clean_run(),
        lambda h: [
            *h[:6],
            Logged(0, 6, PartitionFenced(instance_id="", epoch=9, command_id="f", partition=0)),
            Logged(0, 7, dataclasses.replace(h[5].record, seq=6, epoch=7, key="zombie")),
            *(
                Logged(0, n + 8, dataclasses.replace(x.record, epoch=9))
                for n, x in enumerate(h[6:])
            ),
        ],
    )
    assert len(run.folded.stale) == 1
    assert _problems(run) == ""


def _sleep_first_run(called_ms: int) -> Run:
    """A workflow whose code sleeps 1 s at once; its start was called at ``called_ms``
    and applied 200 ms after ``t``, and the sleep counts from ``t``, when it was taken."""
    plan = {"ops": [{"op": "sleep", "key": "z0", "seconds": 1.0}]}
    i, t = "i-1", 1_000_000
    env = {"instance_id": i, "epoch": 7}
    story: list[HistoryRecord] = [
        WorkflowStarted(
            **env,
            seq=1,
            time_ms=t + 200,
            command_id="c-start",
            workflow="crash-plan",
            version="1",
            input=_json(plan),
        ),
        SleepStarted(
            **env, seq=2, time_ms=t + 200, command_id="c-start", key="z0", wake_at_ms=t + 1000
        ),
        SleepElapsed(**env, seq=3, time_ms=t + 1002, command_id="fire:z0", key="z0"),
        WorkflowCompleted(
            **env, seq=4, time_ms=t + 1002, command_id="fire:z0", result=_json(["slept"])
        ),
    ]
    return _completed_run(plan, story, [Sent("start", i, acked=True, at_ms=called_ms)], [])


def test_a_sleep_begun_at_the_start_counts_from_the_call_not_from_the_apply() -> None:
    # Applied 200 ms after the call, due 1 s after it: on time (docs/workflows.md).
    assert _problems(_sleep_first_run(called_ms=1_000_000)) == ""
    # Due less than 1 s after the client called start: early, whatever the records say.
    assert "sleep z0: wakes at 1001000, too early" in _problems(
        _sleep_first_run(called_ms=1_000_100)
    )


def test_on_kafka_an_acknowledged_event_may_arrive_after_the_end_as_ignored() -> None:
    """kafka:// acknowledges a command once it is durable: when its owner did not confirm
    it in time it may have arrived after the instance finished (recorded as ignored), but
    it may never be lost."""
    run = _clean_run()
    story = run.folded.stories["i-1"]
    late = CommandIgnored(
        instance_id="i-1",
        epoch=7,
        seq=11,
        time_ms=2_000_000,
        command_id="c-late",
        command_type="SendEvent",
        reason="instance is completed",
    )
    run = _refold(run, lambda h: _append(h, late))
    ids = {"c-start": None, "c-ev": "i-1/e1", "c-late": "i-1/e2"}
    commands = [
        Logged(
            0,
            n,
            StartWorkflow(
                instance_id="i-1", command_id=c, workflow="crash-plan", input=story[0].input
            )
            if eid is None
            else SendEvent(instance_id="i-1", command_id=c, name="a", payload=_json({"eid": eid})),
        )
        for n, (c, eid) in enumerate(ids.items())
    ]
    late_sent = Sent("event", "i-1", "i-1/e2", "a", acked=True)
    run = dataclasses.replace(
        run,
        commands=commands,
        sent=[*run.sent, late_sent],
        served={"i-1": [(r.seq, r.type, r.command_id) for r in run.folded.stories["i-1"]]},
    )
    assert _problems(run) == ""
    # Not on the log at all: lost, whatever the backend.
    lost = dataclasses.replace(run, commands=commands[:2])
    assert "the story names a client command c-late not on the log" in _problems(lost)
    embedded = dataclasses.replace(run, commands=None)
    assert "acknowledged event i-1/e2 (a) never arrived" in _problems(embedded)


FAULTS: dict[str, tuple[Callable[[Run], Run], str]] = {
    "a step succeeds twice": (
        lambda run: _refold(
            run, lambda h: _append(h, dataclasses.replace(h[5].record, seq=11, time_ms=2_000_000))
        ),
        "after the step settled",
    ),
    "an attempt beyond the policy": (
        lambda run: _refold(run, lambda h: _replace(h, 4, attempt=3)),
        "the policy allows 2",
    ),
    "a retry before its backoff ended": (
        lambda run: _refold(run, lambda h: _replace(h, 4, time_ms=1_000_050)),
        "before its backoff ended",
    ),
    "a sleep that ends early": (
        lambda run: _refold(run, lambda h: _replace(h, 9, time_ms=1_001_000)),
        "ended 90 ms early",
    ),
    "a gap in the seqs": (
        lambda run: _refold(run, lambda h: [x for x in h if x.record.seq != 8]),
        "without gaps",
    ),
    "an acknowledged event lost": (
        lambda run: dataclasses.replace(
            run, sent=[*run.sent, Sent("event", "i-1", "i-1/e2", "a", acked=True)]
        ),
        "acknowledged event i-1/e2 (a) never arrived",
    ),
    "an event applied twice": (
        lambda run: _refold(
            run,
            lambda h: _append(
                h,
                EventBuffered(
                    instance_id="i-1",
                    epoch=7,
                    seq=11,
                    time_ms=2_000_000,
                    command_id="c-ev2",
                    event_name="a",
                    payload=_json({"eid": "i-1/e1"}),
                ),
            ),
        ),
        "event i-1/e1 arrived 2 times",
    ),
    "a record written before its writer fenced": (
        lambda run: _refold(run, lambda h: _replace(h, 10, epoch=8)),
        "above the partition's fence",
    ),
    "a body run for an attempt the log does not hold": (
        lambda run: dataclasses.replace(
            run, ledger={"i-1": [*run.ledger["i-1"], ("s0", 3, 2, "start", 0.0)]}
        ),
        "which the log does not accept",
    ),
    "the engine serves another history": (
        lambda run: dataclasses.replace(run, served={"i-1": run.served["i-1"][:-1]}),
        "differs from the log's fold",
    ),
    "a paused instance runs code": (
        lambda run: _refold(
            run,
            lambda h: [
                *h[:8],
                Logged(0, 8, WorkflowPaused(instance_id="i-1", epoch=7, seq=8, command_id="c-p")),
                *(
                    Logged(0, n + 9, dataclasses.replace(x.record, seq=x.record.seq + 1))
                    for n, x in enumerate(h[8:])
                ),
            ],
        ),
        "SleepStarted while paused",
    ),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_the_checker_finds(fault: str) -> None:
    inject, expected = FAULTS[fault]
    assert expected in _problems(inject(_clean_run()))


def _cancel_after_the_end(end_by: str, cancel_at: int) -> Run:
    """The clean run on kafka://, plus a cancel the broker acknowledged that the instance
    recorded as ignored (it had finished); the end caused by ``end_by``, the cancel at
    position ``cancel_at`` of the instance's commands on the log."""
    i, t, reason = "i-1", 1_000_000, "cancel i-1/late"
    run = _clean_run()
    plan = run.plans[i]
    log: list[Record] = [
        StartWorkflow(
            instance_id=i, command_id="c-start", workflow="crash-plan", input=_json(plan)
        ),
        TimerFired(instance_id=i, command_id="fire:s0", timer_id="s0", fire_at_ms=t + 55),
        SendEvent(instance_id=i, command_id="c-ev", name="a", payload=_json({"eid": "i-1/e1"})),
        TimerFired(instance_id=i, command_id="fire:z2", timer_id="z2", fire_at_ms=t + 1090),
    ]
    log.insert(cancel_at, CancelWorkflow(instance_id=i, command_id="c-x", reason=reason))
    run.commands = [Logged(0, n, r) for n, r in enumerate(log)]
    ignored = CommandIgnored(
        instance_id=i,
        epoch=7,
        seq=11,
        time_ms=t + 1100,
        command_id="c-x",
        command_type="CancelWorkflow",
        reason="instance is completed",
    )
    run = _refold(
        run,
        lambda h: _append(
            _replace(_replace(h, 9, command_id=end_by), 10, command_id=end_by), ignored
        ),
    )
    run.sent = [*run.sent, Sent("cancel", i, reason, acked=True)]
    run.served = {}
    return run


def test_the_checker_lets_a_cancel_that_reached_the_log_after_the_end_be_ignored() -> None:
    # kafka:// acknowledges a cancel with no owner to say the instance had finished.
    assert _problems(_cancel_after_the_end("fire:z2", cancel_at=4)) == ""


def test_the_checker_catches_an_end_decided_ahead_of_a_cancel_on_the_log() -> None:
    # The sleep's fire came after the cancel on the log: the cancel should have won.
    assert "a cancel was acknowledged" in _problems(_cancel_after_the_end("fire:z2", cancel_at=3))
    # A new owner's recovery ended it while the cancel waited on the log (a CI run's
    # failure before overdue timers were left to fire through the log).
    assert "a cancel was acknowledged" in _problems(_cancel_after_the_end("recover:9", cancel_at=4))
