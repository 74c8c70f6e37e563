"""Kafka at the edges: a ``kafka://`` client needs no live worker.

Workflow names are checked against ``<prefix>.definitions`` (written by every worker on
start); commands are durable once the broker has them and run when a worker returns;
reads of a partition nobody owns say so at once; the cluster topics hold Avro records and
an old JSON announcement is skipped. The README's Kafka quick start runs as typed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stepstream import ConnectionFailed, UnknownWorkflow
from stepstream.consumers.kafka import create_topics
from stepstream.ops.brokers.ports import free_base
from stepstream.producers.client import Client
from stepstream.producers.kafka.members import Member
from tests.conftest import (
    KAFKA_TEST_PARTITIONS,
    ThreadedWorker,
    kafka_settings,
    kafka_url,
)
from tests.conftest import (
    test_registry as workflows_registry,
)
from tests.integration.test_kafka_backend import (
    decode,
    instance_on,
    produce_raw,
    read_topic,
)
from tests.kafka_broker import Broker

REPO = Path(__file__).resolve().parents[2]


async def test_commands_are_accepted_while_every_worker_is_down_and_run_when_one_starts(
    kafka_broker: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
    # An announcement in the JSON of older versions, left on the compacted topic.
    old = b'{"url": "http://10.0.0.9:8233", "partitions": [0, 1], "epoch": 1}'
    await asyncio.to_thread(produce_raw, settings, "members", [(0, b"old-worker", old)])

    # A worker that ran once registered its workflows; then every worker stopped.
    # (It knew one workflow more than the worker that comes back.)
    older = workflows_registry()
    older.add_module("tests.step_workflows")
    first = ThreadedWorker(settings, tmp_path / "first", older)
    try:
        await asyncio.to_thread(first.start)
    finally:
        await asyncio.to_thread(first.stop)

    definitions = [
        decode(r.value) for r in await asyncio.to_thread(read_topic, settings, "definitions")
    ]
    assert {(name, body["name"], body["version"]) for name, body in definitions} >= {
        ("WorkflowRegistered", "gated", "1"),
        ("WorkflowRegistered", "arith", "1"),
    }
    members = await asyncio.to_thread(read_topic, settings, "members")
    announced = [decode(r.value) for r in members if r.value and r.key != b"old-worker"]
    assert announced and {name for name, _ in announced} == {"MemberAnnounced"}

    caplog.set_level(logging.WARNING, "stepstream.kafka.members")
    async with Client.connect(kafka_url(settings)) as client:
        assert any("old-worker" in r.getMessage() for r in caplog.records), caplog.text

        with pytest.raises(UnknownWorkflow) as unknown:
            await client.start("nope", {})
        assert re.search(r"'nope'.*known workflows: .*arith.*gated", str(unknown.value))
        assert "stepstream." not in str(unknown.value)  # the engine's own are not listed
        assert "a worker must have started once with the module" in str(unknown.value).lower()
        with pytest.raises(UnknownWorkflow, match=r"version '9'.*versions: 1"):
            await client.start("gated", "x", version="9")

        # Accepted with no worker running: each returns once the broker has the command.
        instance = instance_on(0, "gated")
        assert await client.start("gated", "g", instance_id=instance) == instance
        for _ in range(2):  # a send retried with its event id applies once
            await client.send_event(instance, "go", "green", event_id="go-1")
        paused = await client.start("gated", "p", instance_id=instance_on(1, "paused"))
        await client.pause(paused)
        await client.resume(paused)
        await client.cancel(paused, reason="no longer needed")

        # Reads of a partition nobody owns answer at once, saying which and since when.
        since = r"no live owner since \d{4}-\d\d-\d\dT[\d:]+\+00:00 \(last owner: worker \w+\)"
        with pytest.raises(ConnectionFailed, match=rf"partition 0: {since}.*no worker of"):
            await client.status(instance)
        with pytest.raises(ConnectionFailed, match=rf"partition 0: {since}"):
            await client.history(instance)
        # Partitions in the same plight (the worker gave up both at once) are one clause.
        with pytest.raises(ConnectionFailed, match=rf"list.*: partitions 0-1: {since}; no"):
            await client.list()
        # A worker killed without withdrawing its announcement: its address does not answer.
        ghost = Member("ghost", "http://127.0.0.1:9", (0, 1), 1, KAFKA_TEST_PARTITIONS)
        await asyncio.to_thread(produce_raw, settings, "members", [(0, b"ghost", ghost.encode())])
        async with Client.connect(kafka_url(settings), timeout=1) as impatient:
            with pytest.raises(ConnectionFailed, match=r"partition 0: its owner, worker ghost"):
                await impatient.status(instance)

        second = ThreadedWorker(settings, tmp_path / "second", workflows_registry())
        try:
            await asyncio.to_thread(second.start)
            assert await client.result(instance, timeout=30) == ["g-before", "green", "g-after"]
            events = [h for h in await client.history(instance) if h.type == "EventBuffered"]
            assert [h.command_id for h in events] == ["go-1"], events
            assert (await client.status(paused)).status == "cancelled"

            # With the owner live a start still returns once the broker has it; reads
            # made at once, while the owner works through a burst of starts, wait for it
            # to apply each one: never "unknown instance".
            burst = [instance_on(0, "fresh") for _ in range(200)]
            await asyncio.gather(*(client.start("gated", "f", instance_id=i) for i in burst))
            statuses = await asyncio.gather(*(client.status(i) for i in burst))
            assert {s.status for s in statuses} == {"running"}, statuses[:3]
            # A start of an existing id is recorded and ignored: the instance's result is
            # the first start's, and its history says what became of the second.
            assert await client.start("gated", "again", instance_id=instance) == instance
            assert await client.result(instance, timeout=30) == ["g-before", "green", "g-after"]
            ignored = [h for h in await client.history(instance) if h.type == "CommandIgnored"]
            assert ignored and "StartWorkflow" in str(ignored[-1].attributes), ignored
            # A workflow only the older worker had: the definitions topic knows it, so
            # the start is accepted; the owner refuses it, and a read of it says why.
            gone = await client.start("overrun-then-quick", None)
            with pytest.raises(UnknownWorkflow, match="overrun-then-quick"):
                await client.result(gone, timeout=30)
        finally:
            await asyncio.to_thread(second.stop)


async def test_reads_fail_at_once_when_no_announced_owner_answers(kafka_broker: Broker) -> None:
    """Workers killed with kill -9 leave their announcements behind. When neither the
    owner nor any other announced worker answers, no running worker can take the
    partition over: a read says so at once, naming them, rather than waiting out its
    timeout; so does a list, which asks every worker."""
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
    port = free_base(2)  # nothing listens there: as a killed worker's address
    ghosts = [
        Member(f"ghost-{p}", f"http://127.0.0.1:{port + p}", (p,), 1, KAFKA_TEST_PARTITIONS)
        for p in range(KAFKA_TEST_PARTITIONS)
    ]
    await asyncio.to_thread(
        produce_raw, settings, "members", [(0, g.worker_id.encode(), g.encode()) for g in ghosts]
    )
    async with Client.connect(kafka_url(settings), timeout=20) as client:
        began = time.monotonic()
        with pytest.raises(ConnectionFailed) as read:
            await client.status(instance_on(0, "gone"))
        assert re.search(
            r"partition 0: its owner, worker ghost-0 at .* did not answer", str(read.value)
        )
        assert "nothing listens at the other announced workers" in str(read.value), read.value
        assert "ghost-1" in str(read.value), read.value  # the other one asked, and named
        with pytest.raises(ConnectionFailed) as listed:
            await client.list()
        assert re.search(r"cannot list instances: .*ghost-0.*ghost-1", str(listed.value)), listed
        assert "stepstream dev" not in str(listed.value)  # a worker, not the dev server
        assert "start `stepstream worker`" in str(listed.value)
        assert time.monotonic() - began < 10, "waited for a hand-over no worker can make"


def _quick_start() -> str:
    """The first shell block of the README's Kafka section."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Kafka\n", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


_STOP_JOBS_NEWEST_FIRST = "for j in $(jobs -p | tac); do kill $j 2>/dev/null; wait $j; done"


async def test_a_start_on_a_prefix_no_worker_registered_on_waits_its_timeout_then_says_so(
    kafka_broker: Broker,
) -> None:
    """Before any worker registered, a start waits for the first one (a script runs
    `stepstream worker &` then `stepstream start`), but only the client's request timeout,
    and then says that no worker has ever registered."""
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, KAFKA_TEST_PARTITIONS)
    async with Client.connect(kafka_url(settings), timeout=2) as client:
        began = time.monotonic()
        with pytest.raises(UnknownWorkflow, match=r"ever registered a workflow.*within 2 s"):
            await client.start("arith", 1)
        assert 1.5 < time.monotonic() - began < 10


def test_the_readme_kafka_quick_start_works_typed_line_after_line(tmp_path: Path) -> None:
    """From the broker on: Apache Kafka, its topics, a worker and a workflow, as typed.
    Only the ports change (tests run side by side) and the examples are copied in."""
    # A one-node Apache broker listens on P and its controller on P+1.
    port = free_base(2)
    prefix = f"qs{uuid.uuid4().hex[:8]}"
    script = (
        _quick_start()
        .replace("stepstream broker --apache", f"stepstream broker --apache --port {port}")
        .replace("127.0.0.1:9092", f"127.0.0.1:{port}")
        .replace("prefix shop", f"prefix {prefix}")
        .replace("prefix=shop", f"prefix={prefix}")
        .replace("--port 8233", "--port 0")
    )
    assert script.startswith("stepstream broker --apache"), script
    assert "stepstream worker" in script and "&\n" in script, script
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    bin_dir = Path(sys.executable).parent
    done = subprocess.run(
        # On exit the worker stops first, then the broker (the newest job first).
        ["bash", "-c", f"set -e\ntrap '{_STOP_JOBS_NEWEST_FIRST}' EXIT\n{script}"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        },
    )
    assert done.returncode == 0, (script, done.stdout, done.stderr[-3000:])
    assert re.search(r"status:\s+completed", done.stdout), done.stdout
    assert "receipt for o-1" in done.stdout, done.stdout


KAFKA_NOWHERE = "kafka://127.0.0.1:1?prefix=nowhere"


def test_topics_create_without_a_reachable_cluster_says_so_in_one_line(tmp_path: Path) -> None:
    """Nothing listens there: the error says what to check, without librdkafka's line
    per connection attempt before it, once ``--timeout`` has passed (60 s unless set)."""
    where = ["--bootstrap", "127.0.0.1:1", "--prefix", "nowhere", "--partitions", "2"]
    command = [sys.executable, "-m", "stepstream.ops.cli", "topics", "create", *where]
    refused = subprocess.run(
        [*command, "--timeout", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "--timeout 0.0 is not" in refused.stderr, refused.stderr
    began = time.monotonic()
    done = subprocess.run(
        [*command, "--timeout", "3"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    # Gave up after its own timeout, not the default 30 s (start-up and the error included).
    assert time.monotonic() - began < 25, done.stderr
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: cannot reach Kafka at 127.0.0.1:1"), lines
    assert "check --bootstrap and the security settings" in lines[0], lines


def test_a_kafka_client_with_no_reachable_cluster_says_why_in_one_line(tmp_path: Path) -> None:
    """``--connect kafka://`` to an address nothing listens at: one line, with the
    reason aiokafka had (refused), not aiokafka's own log line before it."""
    done = subprocess.run(
        [sys.executable, "-m", "stepstream.ops.cli", "list", "--connect", KAFKA_NOWHERE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 4, done.stderr  # the engine is unreachable (docs/cli.md)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: cannot reach Kafka at 127.0.0.1:1: "), lines
    assert "Connection refused" in lines[0], lines


@pytest.mark.slow
def test_a_worker_whose_brokers_are_gone_stops_within_its_bound(tmp_path: Path) -> None:
    """SIGTERM with no broker left to leave the group or flush to: the worker exits once
    its drain timeout plus 20 s have passed, saying why, instead of waiting minutes for
    the producer's message timeout."""
    from stepstream.ops.brokers.apache import start_apache

    cluster = start_apache(1)
    try:
        settings = kafka_settings(cluster)
        create_topics(settings, 2)
        command = [sys.executable, "-m", "stepstream.ops.cli", "worker"]
        command += ["--workflows", "examples.order", "--port", "0"]
        command += ["--bootstrap", settings.bootstrap, "--prefix", settings.prefix]
        command += ["--state-dir", str(tmp_path / "state")]
        worker = subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, "STEPSTREAM_DRAIN_TIMEOUT_S": "1", "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert worker.stdout is not None
            assert "listening on" in worker.stdout.readline()
            cluster.kill_node(0)
            began = time.monotonic()
            worker.terminate()
            _, err = worker.communicate(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
        print(f"the worker exited {time.monotonic() - began:.1f} s after SIGTERM")
        assert worker.returncode == 1, err[-2000:]
        assert "stopping did not finish within 21 s" in err, err[-2000:]
    finally:
        cluster.stop()


def test_the_group_statistics_tell_when_no_broker_is_reachable(kafka_broker: Broker) -> None:
    """What a not-ready worker's /readyz says comes from librdkafka's own statistics: a
    consumer whose brokers are all unreachable is seen so (and since when); one that
    reaches its broker is not."""
    from confluent_kafka import Consumer

    from stepstream.consumers.kafka.group_stats import GroupStatistics

    def up(stats: str) -> bool:
        return any(b.get("state") == "UP" for b in json.loads(stats)["brokers"].values())

    def heard(bootstrap: str, until: Callable[[GroupStatistics, list[str]], bool]) -> Any:
        stats, raw = GroupStatistics({}, None), []

        def hear(text: str) -> None:
            raw.append(text)
            stats.heard(text)

        consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"g-{uuid.uuid4().hex[:8]}",
                "statistics.interval.ms": 100,
                "stats_cb": hear,
                "log_level": 0,
            }
        )
        try:
            consumer.subscribe([f"t-{uuid.uuid4().hex[:8]}"])
            deadline = time.monotonic() + 20
            while not until(stats, raw) and time.monotonic() < deadline:
                consumer.poll(0.1)
        finally:
            consumer.close()
        return stats, raw

    nowhere, _ = heard("127.0.0.1:1", lambda s, _: s.unreachable_since is not None)
    assert nowhere.unreachable_since is not None
    assert time.time() - 30 < nowhere.unreachable_since <= time.time()
    reached, raw = heard(kafka_broker.bootstrap, lambda _, raw: bool(raw) and up(raw[-1]))
    assert raw and up(raw[-1]), raw[-1:]  # heard its broker up
    assert reached.unreachable_since is None


async def test_a_bootstrap_server_that_does_not_answer_is_reported_when_another_does(
    kafka_broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """One of two bootstrap servers is down: the client connects through the other and
    says the first did not answer, as one warning of its own (aiokafka tries the servers
    in a random order: it may reach the live one first, so the client connects until
    it has met the dead one)."""
    settings = kafka_settings(kafka_broker)
    create_topics(settings, KAFKA_TEST_PARTITIONS)
    url = f"kafka://127.0.0.1:1,{kafka_broker.bootstrap}?prefix={settings.prefix}"
    async with Client.connect(kafka_url(settings)):  # the new topics are in the metadata
        pass
    caplog.set_level(logging.WARNING)
    for _ in range(30):  # each time a one-in-two chance: 30 misses are one in a billion
        caplog.clear()
        async with Client.connect(url):
            pass
        warned = [r.getMessage() for r in caplog.records if r.name == "stepstream.kafka.client"]
        if warned:
            break
    assert len(warned) == 1 and '"127.0.0.1:1"' in warned[0], caplog.text
    assert not [r for r in caplog.records if r.name.startswith("aiokafka")], caplog.text
