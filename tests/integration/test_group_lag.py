"""``stepstream topics lag``: the workers' consumer group as the brokers see it, on both
group protocols, with two `stepstream worker` processes under load; and Kafka's own
``kafka-consumer-groups --describe`` (run from the broker's jars) sees the same group,
the same owners and the same committed offsets."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stepstream.consumers.kafka import create_topics, keys
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.wire.topics import COMMANDS, TIMERS, TopicNames, partition_for
from stepstream.producers.client import Client
from tests.conftest import kafka_settings, kafka_url
from tests.faults.test_kafka_failover import WorkerProcess
from tests.kafka_broker import Broker
from tests.kafka_tools import describe_group
from tests.rebalance_probe import GROUP_HEARTBEAT_MS, GROUP_PROTOCOLS, tune_group, worker_settings

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 4


def lag_cli(settings: KafkaSettings, *args: str) -> subprocess.CompletedProcess[str]:
    kafka = ("--bootstrap", settings.bootstrap, "--prefix", settings.prefix)
    return subprocess.run(
        [sys.executable, "-m", "stepstream.ops.cli", "topics", "lag", *kafka, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=dict(os.environ),
    )


def lag_json(settings: KafkaSettings) -> dict[str, Any]:
    done = lag_cli(settings, "--json")
    assert done.returncode == 0, done.stderr
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


async def until_lag(
    settings: KafkaSettings, check: Any, what: str, timeout: float = 60
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        shown = await asyncio.to_thread(lag_json, settings)
        if check(shown):
            return shown
        assert time.monotonic() < deadline, f"{what}: {json.dumps(shown, indent=1)}"
        await asyncio.sleep(0.5)


def rows(shown: dict[str, Any], kind: str, settings: KafkaSettings) -> dict[int, Any]:
    topic = TopicNames(settings.prefix).name(kind)
    return {p["partition"]: p for p in shown["partitions"] if p["topic"] == topic}


@pytest.mark.parametrize("protocol", GROUP_PROTOCOLS)
async def test_topics_lag_shows_the_workers_group_as_kafkas_own_tool_does(
    kafka_broker: Broker, tmp_path: Path, protocol: str
) -> None:
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, PARTITIONS)
    group = keys.group_id(settings.prefix)

    # No worker has joined yet: a clear error, not an empty table.
    missing = await asyncio.to_thread(lag_cli, settings)
    assert missing.returncode != 0
    assert f"consumer group {group} has no members" in missing.stderr, missing.stderr
    assert f"stepstream worker --prefix {settings.prefix}" in missing.stderr, missing.stderr

    options, env = worker_settings(protocol)
    await asyncio.to_thread(tune_group, settings, protocol, GROUP_HEARTBEAT_MS)
    workers = [
        WorkerProcess(
            settings,
            tmp_path / f"w{i}",
            tmp_path,
            tmp_path / f"w{i}.log",
            workflows="tests.fault_workflows",
            env=env,
            options=options,
        )
        for i in range(2)
    ]
    try:
        for worker in workers:
            await asyncio.to_thread(worker.start)
        commands = TopicNames(settings.prefix).name(COMMANDS)

        def both_own(shown: dict[str, Any]) -> bool:
            owned = rows(shown, COMMANDS, settings)
            return (
                shown["members"] == 2
                and len(owned) == PARTITIONS
                and len({p["member"] for p in owned.values() if p["member"]}) == 2
                and all(p["member"] for p in owned.values())
            )

        await until_lag(settings, both_own, "the two workers never shared the partitions")
        # Load: tickers on every partition, for a few seconds.
        ids = [f"lag-{n}" for n in range(64)]
        assert {partition_for(i, PARTITIONS) for i in ids} == set(range(PARTITIONS))
        async with Client.connect(kafka_url(settings)) as client:
            for instance in ids:
                await client.start("ticker", {"steps": 30, "seconds": 0.02}, instance_id=instance)

            # Under load: every partition of both topics, committed offsets that trail the
            # ends by what is not applied yet, and owners.
            def busy(shown: dict[str, Any]) -> bool:
                timers = rows(shown, TIMERS, settings)
                return len(timers) == PARTITIONS and all(
                    p["committed"] is not None for p in timers.values()
                )

            shown = await until_lag(settings, busy, "the workers never committed timers offsets")
            assert shown["group"] == group
            assert shown["protocol"] == protocol
            assert shown["state"] == "stable"
            owned = rows(shown, COMMANDS, settings)
            for kind in (COMMANDS, TIMERS):
                for p in rows(shown, kind, settings).values():
                    assert p["committed"] is not None and p["committed"] <= p["end"], p
                    assert p["lag"] == p["end"] - p["committed"], p
                    # A worker's timers partition is its commands partition's twin.
                    assert p["member"] == owned[p["partition"]]["member"], p
                    assert p["client_id"].startswith("stepstream-worker-"), p

            # Kafka's own tool, while the load runs: the same owners, and each committed
            # offset between what ours showed just before and just after it.
            kafka_view = await asyncio.to_thread(describe_group, settings.bootstrap, group)
            after = await asyncio.to_thread(lag_json, settings)
            theirs = {(r["TOPIC"], int(r["PARTITION"])): r for r in kafka_view}
            ours_before = {(p["topic"], p["partition"]): p for p in shown["partitions"]}
            ours_after = {(p["topic"], p["partition"]): p for p in after["partitions"]}
            assert set(theirs) == set(ours_before), (kafka_view, shown)
            for key, row in theirs.items():
                low, high = ours_before[key]["committed"], ours_after[key]["committed"]
                assert low <= int(row["CURRENT-OFFSET"]) <= high, (key, row, low, high)
                if key[0] == commands:
                    assert row["CONSUMER-ID"] == ours_after[key]["member"], (row, after)
                    assert row["CLIENT-ID"] == ours_after[key]["client_id"], (row, after)

            for instance in ids:
                await client.result(instance, timeout=120)

        # The load is done: the group catches up to the ends, and the two views agree to
        # the offset.
        idle = await until_lag(
            settings, lambda s: s["total_lag"] == 0, "the group never caught up", timeout=60
        )
        assert all(p["committed"] == p["end"] > 0 for p in rows(idle, COMMANDS, settings).values())
        kafka_view = await asyncio.to_thread(describe_group, settings.bootstrap, group)
        for row in kafka_view:
            mine = {(p["topic"], p["partition"]): p for p in idle["partitions"]}[
                (row["TOPIC"], int(row["PARTITION"]))
            ]
            assert int(row["CURRENT-OFFSET"]) == mine["committed"], (row, mine)
            assert int(row["LOG-END-OFFSET"]) == mine["end"], (row, mine)
            assert row["LAG"] == "0", row

        # The table for people: the group's line, then a row per partition.
        human = await asyncio.to_thread(lag_cli, settings)
        assert human.returncode == 0, human.stderr
        head, columns, *table = human.stdout.splitlines()
        assert head.startswith(f"group {group}: stable, {protocol} protocol"), head
        assert "2 members, total lag 0" in head, head
        assert columns.split() == ["TOPIC", "PARTITION", "COMMITTED", "END", "LAG", "OWNER"]
        assert len(table) == 2 * PARTITIONS, human.stdout
    finally:
        for worker in workers:
            worker.stop()
