"""kill -9 of a `stepstream dev` process, and a restart on the same data directory.

Each test runs the real CLI as a subprocess (the test workflows of ``tests.workflows``,
their step bodies counted in ledger files), kills it by pid with SIGKILL at a chosen
moment, starts it again on the same data directory and port, and checks the guarantees
of design.md: no acknowledged command lost, no transition applied twice, no step success
recorded twice, step bodies at-least-once but within their retry policy across crashes.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path

import aiohttp
import pytest

from stepstream import Client, HistoryEntry, WorkflowFailed
from stepstream.consumers.embedded import EmbeddedDB
from stepstream.engine.wire.records import HistoryRecord, PartitionFenced, StepSucceeded
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import DEAD_LETTERS, HISTORY
from tests.workflows import ledger_count

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Dev:
    """One data directory served by successive `stepstream dev` processes."""

    def __init__(self, root: Path) -> None:
        self.data = root / "data"
        self.ledger = root / "ledger"
        self.ledger.mkdir()
        self.log = root / "dev.log"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def env(self) -> dict[str, str]:
        path = os.environ.get("PYTHONPATH", "")
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), path) if p),
            "STEPSTREAM_TEST_LEDGER": str(self.ledger),
        }

    async def start(self) -> None:
        assert self.proc is None, "already running"
        self.starts += 1
        with open(self.log, "ab") as log:
            log.write(f"---- start {self.starts} ----\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "stepstream.ops.cli",
                    "dev",
                    "--workflows",
                    "tests.workflows,tests.lifecycle_workflows",
                    "--data",
                    str(self.data),
                    "--port",
                    str(self.port),
                    "--partitions",
                    str(PARTITIONS),
                    "--log-level",
                    "WARNING",
                ],
                cwd=REPO,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20
        async with aiohttp.ClientSession() as http:
            while True:
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    self.proc = None
                    pytest.fail(f"stepstream dev exited with {code}:\n{self.log.read_text()}")
                try:
                    async with http.get(f"{self.url}/healthz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    self.kill9()
                    pytest.fail(f"stepstream dev never became healthy:\n{self.log.read_text()}")
                await asyncio.sleep(0.02)

    def kill9(self) -> None:
        assert self.proc is not None, "not running"
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    async def restart_after_kill9(self, down_for: float = 0.0) -> None:
        self.kill9()
        if down_for:
            await asyncio.sleep(down_for)
        await self.start()

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"stepstream dev ignored SIGTERM:\n{self.log.read_text()}"
            ) from None
        finally:
            self.proc = None

    def ran(self, name: str) -> int:
        return ledger_count(self.ledger, name)

    @asynccontextmanager
    async def client(self) -> AsyncIterator[Client]:
        async with Client.connect(self.url) as client:
            yield client


@pytest.fixture
async def dev(tmp_path: Path) -> AsyncIterator[Dev]:
    server = Dev(tmp_path)
    await server.start()
    try:
        yield server
    finally:
        server.stop()


async def wait_for(
    predicate: Callable[[], Awaitable[bool] | bool], what: str, timeout: float = 15
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        outcome = predicate()
        if not isinstance(outcome, bool):
            outcome = await outcome
        if outcome:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def waiting_on(client: Client, instance: str, kind: str) -> bool:
    status = await client.status(instance)
    return any(w.kind == kind for w in status.waits)


def render(instance: str, history: Iterable[HistoryEntry]) -> str:
    lines = [f"history of {instance}:"]
    lines += [f"  {h.seq:3d} {h.time} {h.type} {h.command_id} {h.attributes}" for h in history]
    return "\n".join(lines)


@asynccontextmanager
async def explained(dev: Dev, *instances: str) -> AsyncIterator[None]:
    """On failure, print each instance's history (and the server log) before re-raising."""
    try:
        yield
    except BaseException:
        try:
            async with dev.client() as client:
                for instance in instances:
                    print(render(instance, await client.history(instance)))
        except Exception as exc:
            print(f"could not read history: {exc!r}")
        print(f"server log:\n{dev.log.read_text()[-5000:]}")
        raise


def check_history(instance: str, history: list[HistoryEntry]) -> None:
    """What every history must satisfy, crash or no crash."""
    why = render(instance, history)
    assert [h.seq for h in history] == list(range(1, len(history) + 1)), why
    succeeded = Counter(h.attributes["key"] for h in history if h.type == "StepSucceeded")
    assert all(n == 1 for n in succeeded.values()), why
    attempts: dict[str, list[int]] = {}
    for h in history:
        if h.type == "StepAttemptStarted":
            assert h.attributes["attempt"] <= h.attributes["max_attempts"], why
            attempts.setdefault(h.attributes["key"], []).append(h.attributes["attempt"])
    for numbers in attempts.values():
        assert numbers == list(range(1, len(numbers) + 1)), why
    types = [h.type for h in history]
    assert types.count("WorkflowStarted") == 1, why
    finished = [t for t in types if t in ("WorkflowCompleted", "WorkflowFailed")]
    assert len(finished) <= 1 and (not finished or types[-1] == finished[0]), why


def of_type(history: list[HistoryEntry], kind: str, key: str | None = None) -> list[HistoryEntry]:
    return [
        h for h in history if h.type == kind and (key is None or h.attributes.get("key") == key)
    ]


def _ms(iso: str) -> int:
    return round(datetime.fromisoformat(iso).timestamp() * 1000)


# ---- (a) killed while a step body runs ------------------------------------------------


async def test_kill_during_step_body_reruns_it_within_policy(dev: Dev) -> None:
    name = "long-a"
    async with dev.client() as client:
        await client.start("long-step", {"name": name, "seconds": 1.5, "max": 3}, instance_id=name)
    await wait_for(lambda: dev.ran(f"{name}-started") == 1, "the step body to start")
    await dev.restart_after_kill9()

    async with explained(dev, name), dev.client() as client:
        assert await client.result(name, timeout=20) == name
        history = await client.history(name)
        check_history(name, history)
        why = render(name, history)
        attempts = of_type(history, "StepAttemptStarted", "long")
        assert len(attempts) == 2, why
        (lost,) = of_type(history, "StepFailed", "long")
        assert lost.attributes["error_type"] == "AttemptLost", why
        assert lost.attributes["next_attempt_at_ms"] is not None, why
        assert len(of_type(history, "StepSucceeded", "long")) == 1, why
    assert dev.ran(f"{name}-started") == 2  # the killed attempt and its retry
    assert dev.ran(f"{name}-finished") == 1
    assert dev.ran(f"{name}-tail") == 1


async def test_kill_uses_up_the_only_attempt_and_the_workflow_fails(dev: Dev) -> None:
    name = "long-max1"
    async with dev.client() as client:
        await client.start("long-step", {"name": name, "seconds": 1.5, "max": 1}, instance_id=name)
    await wait_for(lambda: dev.ran(f"{name}-started") == 1, "the step body to start")
    await dev.restart_after_kill9()

    async with explained(dev, name), dev.client() as client:
        with pytest.raises(WorkflowFailed) as failed:
            await client.result(name, timeout=20)
        assert failed.value.error_type == "StepFailed"
        assert "AttemptLost" in str(failed.value)
        history = await client.history(name)
        check_history(name, history)
        why = render(name, history)
        assert len(of_type(history, "StepAttemptStarted", "long")) == 1, why
        (lost,) = of_type(history, "StepFailed", "long")
        assert lost.attributes["error_type"] == "AttemptLost", why
        assert lost.attributes["next_attempt_at_ms"] is None, why
        assert of_type(history, "StepAttemptStarted", "tail") == [], why
        assert (await client.status(name)).status == "failed"
    assert dev.ran(f"{name}-started") == 1
    assert dev.ran(f"{name}-tail") == 0


# ---- (b) killed while the workflow sleeps ---------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "down_for"),
    [(1.5, 0.0), (0.3, 0.8)],
    ids=["timer-pending-at-restart", "timer-overdue-at-restart"],
)
async def test_kill_during_sleep(dev: Dev, seconds: float, down_for: float) -> None:
    name = f"nap-{seconds}"
    async with dev.client() as client:
        await client.start("nap-then-step", {"name": name, "seconds": seconds}, instance_id=name)
        await wait_for(lambda: waiting_on(client, name, "sleep"), "the sleep to start")
    await dev.restart_after_kill9(down_for)

    async with explained(dev, name), dev.client() as client:
        assert await client.result(name, timeout=20) == f"{name}-second"
        history = await client.history(name)
        check_history(name, history)
        why = render(name, history)
        (started,) = of_type(history, "SleepStarted", "nap")
        (elapsed,) = of_type(history, "SleepElapsed", "nap")
        assert _ms(elapsed.time) >= started.attributes["wake_at_ms"], why
        assert _ms(elapsed.time) - _ms(started.time) >= seconds * 1000 - 1, why
    assert dev.ran(f"{name}-first") == 1
    assert dev.ran(f"{name}-second") == 1


# ---- (c) killed while waiting for an event --------------------------------------------


async def test_kill_during_wait_for_event(dev: Dev) -> None:
    name = "gate-c"
    async with dev.client() as client:
        await client.start("gated", name, instance_id=name)
        await wait_for(lambda: waiting_on(client, name, "wait"), "the wait to start")
    await dev.restart_after_kill9()

    async with explained(dev, name), dev.client() as client:
        assert (await client.status(name)).status == "running"
        await client.send_event(name, "go", "green")
        assert await client.result(name, timeout=20) == [f"{name}-before", "green", f"{name}-after"]
        check_history(name, await client.history(name))
    assert dev.ran(f"{name}-before") == 1
    assert dev.ran(f"{name}-after") == 1


async def test_event_acknowledged_before_kill_is_not_lost(dev: Dev) -> None:
    name = "gate-early"
    async with dev.client() as client:
        await client.start("gated", name, instance_id=name)
        await client.send_event(name, "go", "early")  # acknowledged: must survive
    await dev.restart_after_kill9()

    async with explained(dev, name), dev.client() as client:
        assert await client.result(name, timeout=20) == [f"{name}-before", "early", f"{name}-after"]
        history = await client.history(name)
        check_history(name, history)
        assert len(of_type(history, "WaitSatisfied")) == 1, render(name, history)
        # The kill may land while a body runs: it may run again, but never more often
        # than it has durable attempts.
        for key in ("before", "after"):
            attempts = len(of_type(history, "StepAttemptStarted", key))
            assert 1 <= dev.ran(f"{name}-{key}") <= attempts, render(name, history)


# ---- (d) many instances killed mid-flight ---------------------------------------------

INSTANCES = 50
STEPS = 20


async def _read_log(data: Path) -> dict[str, list[HistoryRecord]]:
    """The history topic as any Kafka tool would read it; checks there are no dead letters."""
    serde = default_serde()
    db = await EmbeddedDB.open(str(data))
    try:
        by_instance: dict[str, list[HistoryRecord]] = {}
        for partition in range(db.partitions):
            dead = db.log.read(DEAD_LETTERS, partition, 0, 1000)
            assert dead == [], [serde.decode(d.value) for d in dead]
            for entry in db.log.read(HISTORY, partition, 0, 1_000_000):
                record = serde.decode(entry.value)
                assert isinstance(record, HistoryRecord)
                if not isinstance(record, PartitionFenced):
                    by_instance.setdefault(record.instance_id, []).append(record)
        return by_instance
    finally:
        await db.close()


async def reached(client: Client, instance: str, step: int) -> bool:
    """Whether a chain is running step ``step`` or later."""
    status = await client.status(instance)
    running = [int(w.key[1:]) for w in status.waits if w.kind == "step"]
    return status.finished or max(running, default=-1) >= step


async def test_many_instances_killed_mid_flight(dev: Dev) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed {seed}")
    ids = [f"chain-{i:02d}" for i in range(INSTANCES)]
    # Every start is acknowledged before the first kill. Each kill comes when a randomly
    # chosen chain has reached a random step (whatever the machine's speed), plus a
    # random few milliseconds; the second one while the restarted engine catches up.
    async with dev.client() as client:
        await asyncio.gather(*(client.start("chain", STEPS, instance_id=i) for i in ids))
        probe, step = rng.choice(ids), rng.randrange(1, STEPS // 2)
        await wait_for(lambda: reached(client, probe, step), f"{probe} to reach step {step}")
    await asyncio.sleep(rng.uniform(0, 0.03))
    await dev.restart_after_kill9()
    async with dev.client() as client:
        probe, step = rng.choice(ids), rng.randrange(STEPS // 2, STEPS)
        await wait_for(lambda: reached(client, probe, step), f"{probe} to reach step {step}")
    await dev.restart_after_kill9()

    async with dev.client() as client:
        for instance in ids:
            async with explained(dev, instance):
                assert await client.result(instance, timeout=30) == STEPS, f"seed {seed}"
                history = await client.history(instance)
                check_history(instance, history)
                keys = [h.attributes["key"] for h in of_type(history, "StepSucceeded")]
                assert keys == [f"s{n}" for n in range(STEPS)], render(instance, history)

    # The history topic itself (not only the state the API reads) has every instance's
    # records exactly once, in order.
    dev.stop()
    logged = await _read_log(dev.data)
    assert sorted(logged) == ids
    for instance, records in logged.items():
        assert [r.seq for r in records] == list(range(1, len(records) + 1)), (
            f"seed {seed}: {instance} history topic:\n"
            + "\n".join(f"  {r.seq} epoch={r.epoch} {r.type}" for r in records)
        )
    # The test means something only if a kill caught instances half way: some of their
    # steps succeeded under one process, the rest under a later one.
    resumed = [
        i
        for i, records in logged.items()
        if any(isinstance(r, StepSucceeded) and r.epoch < records[-1].epoch for r in records)
    ]
    print(f"seed {seed}: {len(resumed)} of {INSTANCES} instances were caught half way")
    assert resumed, f"seed {seed}: no kill caught a chain half way"
