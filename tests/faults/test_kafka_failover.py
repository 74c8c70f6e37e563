"""Kafka workers as real processes: kill -9, failover to a new worker, and a group of two.

Workers are `stepstream worker` subprocesses (the test workflows of ``tests.workflows``,
step bodies counted in ledger files) in one consumer group; the test drives them through
a ``kafka://`` client and watches ``<prefix>.members`` to know who owns what. Killed by
pid with SIGKILL at a chosen moment, a worker loses its in-flight step attempt and its
local state (or keeps the state, when the successor reuses its directory); the successor
restores from the history topic and must finish every workflow without a duplicated step
success, within each step's retry policy.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import aiohttp
import pytest

from stepstream.consumers.kafka import create_topics
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.wire.topics import MEMBERS, TopicNames, partition_for
from stepstream.producers.client import Client
from stepstream.producers.kafka import aiokafka_options
from stepstream.producers.kafka.members import MembersView
from tests.conftest import KAFKA_TEST_OPTIONS, kafka_settings, kafka_url
from tests.kafka_broker import Broker
from tests.processes import launch, repo_env, worker_command
from tests.workflows import ledger_count

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

REPO = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """One `stepstream worker` subprocess; stopped by pid."""

    def __init__(
        self,
        settings: KafkaSettings,
        state_dir: Path,
        ledger: Path,
        log: Path,
        *,
        workflows: str = "tests.workflows",
        env: dict[str, str] | None = None,
        options: Sequence[str] = KAFKA_TEST_OPTIONS,
    ) -> None:
        self.settings = settings
        self.options = options
        self.workflows = workflows
        self.env = env or {}
        self.state_dir = state_dir
        self.ledger = ledger
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        command = worker_command(
            self.workflows,
            self.settings.bootstrap,
            self.settings.prefix,
            self.state_dir,
            self.options,
        )
        env = repo_env(STEPSTREAM_TEST_LEDGER=str(self.ledger), **self.env)
        self.proc, self.url = launch(command, env=env, log=self.log)

    def kill(self) -> None:
        """kill -9."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """A clean stop (SIGTERM): hands its partitions over and leaves the group."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                assert self.proc.wait(30) == 0, self.log.read_text()[-3000:]
            except subprocess.TimeoutExpired:
                self.kill()
                raise


@pytest.fixture
async def members(
    kafka_broker: Broker,
) -> AsyncIterator[Callable[[KafkaSettings], Awaitable[MembersView]]]:
    opened: list[MembersView] = []

    async def open_view(settings: KafkaSettings) -> MembersView:
        view = await MembersView.open(
            TopicNames(settings.prefix).name(MEMBERS),
            timeout=10,
            **aiokafka_options(settings, "consumer"),
        )
        opened.append(view)
        return view

    yield open_view
    for view in opened:
        await view.close()


async def owned_by(
    view: MembersView,
    partitions: int,
    expect: Callable[[dict[int, str]], bool],
    timeout: float = 30,
) -> dict[int, str]:
    """Wait until the partitions' owners (by URL) satisfy ``expect``."""
    deadline = time.monotonic() + timeout
    while True:
        owners = {p: m.url for p in range(partitions) if (m := view.owner(p)) is not None}
        if expect(owners):
            return owners
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"partitions never got the expected owners: {owners}")
        await view.changed(remaining)


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def no_duplicate_success(client: Client, instance: str) -> None:
    history = await client.history(instance)
    successes = Counter(h.attributes["key"] for h in history if h.type == "StepSucceeded")
    assert all(n == 1 for n in successes.values()), [(h.seq, h.type, h.attributes) for h in history]


async def fresh_cluster(
    broker: Broker, tmp_path: Path, partitions: int, *state_dirs: str
) -> tuple[KafkaSettings, Path, list[WorkerProcess]]:
    """Topics of ``partitions`` on a new prefix, a step ledger, and one worker (not yet
    started) per state directory named (a name given twice: a successor on that one)."""
    settings = kafka_settings(broker)
    await asyncio.to_thread(create_topics, settings, partitions)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    log = tmp_path / "workers.log"
    return (
        settings,
        ledger,
        [WorkerProcess(settings, tmp_path / d, ledger, log) for d in state_dirs],
    )


@pytest.mark.parametrize("successor", ["same-state-dir", "empty-state-dir"])
async def test_kill_9_during_a_step_a_sleep_and_a_wait(
    kafka_broker: Broker,
    tmp_path: Path,
    successor: str,
    members: Callable[[KafkaSettings], Awaitable[MembersView]],
) -> None:
    partitions = 2
    second_dir = "a" if successor == "same-state-dir" else "b"
    settings, ledger, (first, second) = await fresh_cluster(
        kafka_broker, tmp_path, partitions, "a", second_dir
    )
    view = await members(settings)
    try:
        await asyncio.to_thread(first.start)
        await owned_by(
            view, partitions, lambda o: set(o.values()) == {first.url} and len(o) == partitions
        )
        async with Client.connect(kafka_url(settings)) as client:
            step = await client.start(
                "long-step", {"name": "long", "seconds": 3, "max": 3}, instance_id="i-step"
            )
            nap = await client.start(
                "nap-then-step", {"name": "nap", "seconds": 2.5}, instance_id="i-nap"
            )
            gate = await client.start("gated", "gate", instance_id="i-gate")

            async def all_in_flight() -> bool:
                napping = any(w.kind == "sleep" for w in (await client.status(nap)).waits)
                waiting = any(w.kind == "wait" for w in (await client.status(gate)).waits)
                return ledger_count(ledger, "long-started") == 1 and napping and waiting

            await until(all_in_flight, "a step running, a sleep and a wait pending")
            first.kill()

            await asyncio.to_thread(second.start)
            await owned_by(
                view, partitions, lambda o: set(o.values()) == {second.url} and len(o) == partitions
            )
            await client.send_event(gate, "go", "green")
            assert await client.result(step, timeout=30) == "long"
            assert await client.result(nap, timeout=30) == "nap-second"
            assert await client.result(gate, timeout=30) == ["gate-before", "green", "gate-after"]
            for instance in (step, nap, gate):
                await no_duplicate_success(client, instance)

            # The killed attempt ran again, once, as a new attempt within the policy.
            attempts = [
                (h.attributes["attempt"], h.type)
                for h in await client.history(step)
                if h.type in ("StepAttemptStarted", "StepFailed", "StepSucceeded")
                and h.attributes["key"] == "long"
            ]
            assert attempts == [
                (1, "StepAttemptStarted"),
                (1, "StepFailed"),
                (2, "StepAttemptStarted"),
                (2, "StepSucceeded"),
            ]
            assert ledger_count(ledger, "long-started") == 2
            assert ledger_count(ledger, "long-finished") == 1
            # What had succeeded before the kill did not run again.
            assert ledger_count(ledger, "nap-first") == 1
            assert ledger_count(ledger, "gate-before") == 1
            assert ledger_count(ledger, "long-tail") == 1
    finally:
        first.kill()
        second.stop()


async def test_two_workers_share_the_partitions_and_hand_over_cleanly(
    kafka_broker: Broker,
    tmp_path: Path,
    members: Callable[[KafkaSettings], Awaitable[MembersView]],
) -> None:
    partitions = 4
    settings, ledger, (a, b) = await fresh_cluster(kafka_broker, tmp_path, partitions, "a", "b")
    view = await members(settings)
    try:
        await asyncio.to_thread(a.start)
        await asyncio.to_thread(b.start)
        owners = await owned_by(
            view, partitions, lambda o: len(o) == partitions and set(o.values()) == {a.url, b.url}
        )
        async with Client.connect(kafka_url(settings)) as client:
            ids = [f"pair-{i}" for i in range(12)]
            started = await asyncio.gather(
                *(client.start("arith", i, instance_id=i_) for i, i_ in enumerate(ids))
            )
            results = await asyncio.gather(*(client.result(i, timeout=30) for i in started))
            assert results == [{"total": i + 1, "doubled": 2 * (i + 1)} for i in range(12)]
            served_by = {owners[partition_for(i, partitions)] for i in ids}
            assert served_by == {a.url, b.url}, "both workers should have served instances"
            # A worker's REST API asked for an instance it does not own: 503, and when to
            # ask again (of its owner: the message says which partition).
            elsewhere = next(i for i in ids if owners[partition_for(i, partitions)] == b.url)
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{a.url}/v1/instances/{elsewhere}") as answer:
                    assert answer.status == 503, await answer.text()
                    assert answer.headers["Retry-After"] == "2"
                    assert "does not own" in (await answer.json())["error"]["message"]
            assert {s.instance_id for s in await client.list()} == set(ids)

            on_b = next(
                f"handover-{n}"
                for n in range(1000)
                if owners[partition_for(f"handover-{n}", partitions)] == b.url
            )
            await client.start("gated", on_b, instance_id=on_b)
            await until(lambda: _waiting(client, on_b), f"{on_b} waiting for its event")
            # A step with a single attempt is running on b when b is stopped: the
            # hand-over lets it finish and records it, so no attempt is lost (a lost
            # one would fail this workflow).
            busy = next(
                f"drain-{n}"
                for n in range(1000)
                if owners[partition_for(f"drain-{n}", partitions)] == b.url
            )
            await client.start(
                "long-step", {"name": busy, "seconds": 1.5, "max": 1}, instance_id=busy
            )

            async def running() -> bool:
                return ledger_count(ledger, f"{busy}-started") == 1

            await until(running, f"{busy} running its step")
            await asyncio.to_thread(b.stop)
            await owned_by(
                view, partitions, lambda o: set(o.values()) == {a.url} and len(o) == partitions
            )
            await client.send_event(on_b, "go", 1)
            assert await client.result(on_b, timeout=30) == [f"{on_b}-before", "1", f"{on_b}-after"]
            await no_duplicate_success(client, on_b)
            assert await client.result(busy, timeout=30) == busy
            history = await client.history(busy)
            assert [h.attributes.get("error_type") for h in history if h.type == "StepFailed"] == []
            assert ledger_count(ledger, f"{busy}-started") == 1
            assert ledger_count(ledger, f"{busy}-finished") == 1
            assert ledger_count(ledger, f"{busy}-tail") == 1
            assert {s.instance_id for s in await client.list()} == {*ids, on_b, busy}
    finally:
        a.stop()
        b.stop()


async def _waiting(client: Client, instance: str) -> bool:
    status = await client.status(instance)
    return any(w.kind == "wait" for w in status.waits)


async def test_a_cancel_sent_while_no_worker_runs_wins_over_the_last_attempt_it_lost(
    kafka_broker: Broker,
    tmp_path: Path,
    members: Callable[[KafkaSettings], Awaitable[MembersView]],
) -> None:
    """The worker dies during a step's only attempt; the cancel the client sends while
    no worker runs is on the log ahead of anything the successor decides, so the
    instance ends cancelled: the lost attempt does not fail it first (which would run
    the code on and make the acknowledged cancel come too late)."""
    partitions = 2
    settings, ledger, (first, second) = await fresh_cluster(
        kafka_broker, tmp_path, partitions, "a", "a"
    )
    view = await members(settings)
    try:
        await asyncio.to_thread(first.start)
        await owned_by(view, partitions, lambda o: len(o) == partitions)
        async with Client.connect(kafka_url(settings)) as client:
            name = "last-attempt"
            await client.start(
                "long-step", {"name": name, "seconds": 3, "max": 1}, instance_id=name
            )

            async def running() -> bool:
                return ledger_count(ledger, f"{name}-started") == 1

            await until(running, f"{name} running its only attempt")
            first.kill()
            await client.cancel(name, reason="called off while the workers were down")

            await asyncio.to_thread(second.start)
            await owned_by(
                view, partitions, lambda o: set(o.values()) == {second.url} and len(o) == partitions
            )

            async def ended() -> bool:
                return (await client.status(name)).status in ("cancelled", "failed", "completed")

            await until(ended, f"{name} to end", timeout=30)
            history = await client.history(name)
            story = [(h.seq, h.type, h.attributes) for h in history]
            assert (await client.status(name)).status == "cancelled", story
            assert [h.type for h in history if h.type == "StepFailed"] == [], story
            assert ledger_count(ledger, f"{name}-started") == 1  # not run again
            assert ledger_count(ledger, f"{name}-tail") == 0
    finally:
        first.kill()
        second.stop()


def _ready(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_a_worker_beyond_the_partition_count_is_ready_and_takes_over_when_needed(
    kafka_broker: Broker,
    tmp_path: Path,
    members: Callable[[KafkaSettings], Awaitable[MembersView]],
) -> None:
    """More workers than partitions (a scaled-out deployment, a standby): the one the
    group gives nothing has joined all the same, so its readiness probe passes (a
    rollout waiting for it must not hang), and it takes the partition over when the
    owner leaves."""
    settings, _ledger, (a, b) = await fresh_cluster(kafka_broker, tmp_path, 1, "a", "b")
    view = await members(settings)
    try:
        await asyncio.to_thread(a.start)
        await owned_by(view, 1, lambda o: o == {0: a.url})
        await asyncio.to_thread(b.start)
        deadline = time.monotonic() + 30
        while (found := await asyncio.to_thread(_ready, b.url))[0] != 200:
            assert time.monotonic() < deadline, f"the idle worker never got ready: {found}"
            await asyncio.sleep(0.2)
        assert found == (200, {"ready": True})
        assert view.owner(0) is not None and view.owner(0).url == a.url  # type: ignore[union-attr]
        await asyncio.to_thread(a.stop)
        await owned_by(view, 1, lambda o: o == {0: b.url})
        async with Client.connect(kafka_url(settings)) as client:
            started = await client.start("arith", 4, instance_id="after-a")
            assert await client.result(started, timeout=30) == {"total": 5, "doubled": 10}
    finally:
        await asyncio.to_thread(b.stop)
        await asyncio.to_thread(a.stop)
