"""Incremental rebalancing, against Apache Kafka with `stepstream worker` processes:
three workers join a group of 12 partitions one by one, then two of them leave one by
one, while workflows run on every partition and commands keep coming; on the classic
protocol (cooperative-sticky) and on KIP-848's consumer protocol. Only the partitions
that change hands move: each worker's group consumer is revoked exactly the partitions
it gives up and assigned exactly those it takes (its log says so), each moved partition
is fenced once with a higher epoch and nothing the old owner writes after it, the
partitions that stay are never taken over again and keep writing history while the
moved ones have no owner, and every acknowledged command is applied once.

The scenario and what it reads from the topics are in ``tests/rebalance_probe.py``,
which also prints the timings of docs/kafka-notes.md; nothing here asserts a timing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from stepstream.consumers.kafka import create_topics, keys
from stepstream.engine.wire.topics import COMMANDS, MEMBERS, TIMERS, TopicNames
from stepstream.producers.kafka import aiokafka_options
from stepstream.producers.kafka.members import MembersView
from tests.conftest import kafka_settings
from tests.faults.test_kafka_failover import WorkerProcess
from tests.kafka_broker import Broker
from tests.rebalance_probe import GATES, GROUP_PROTOCOLS, PARTITIONS, Phase, run_scenario

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

# 12 partitions: 12 on one worker, 6 each on two, 4 each on three. The fewest that can
# move: 6 to the second, 2 from each to the third, the leaver's 4 (2 to each of the
# others), then the leaver's 6.
MOVING = {"join 2": 6, "join 3": 4, "leave 3": 4, "leave 2": 6}


def _check(phase: Phase) -> None:
    detail = f"{phase.name}: {phase}"
    moving = MOVING[phase.name]
    assert len(phase.moved) == moving, detail
    assert len(phase.stayed) == PARTITIONS - moving, detail
    # Each worker's group consumer gave up exactly what left it and took exactly what
    # came to it: a partition that stayed with a worker was never revoked.
    for url, events in phase.group_events.items():
        gave = {p for p, (old, _new) in phase.moved.items() if old == url}
        took = {p for p, (_old, new) in phase.moved.items() if new == url}
        assert events["revoked"] == gave, f"{url} {events} {detail}"
        assert events["assigned"] == took, f"{url} {events} {detail}"
        assert events["lost"] == set(), f"{url} {events} {detail}"
    # A partition that stayed was not taken over again (every take-over appends a fence
    # before anything else)...
    assert phase.stayed_refenced == [], detail
    # ... nor announced on <prefix>.members as unowned or another's at any point.
    assert phase.stayed_reannounced == [], detail
    # It kept writing history while the moved partitions had no owner.
    assert all(n > 0 for n in phase.stayed_records_in_handover.values()), detail
    for partition in phase.moved:
        # A moved partition was taken over once, with an epoch above the one it had...
        assert len(phase.new_fences[partition]) == 1, detail
        assert phase.new_fences[partition][0] > phase.old_epochs[partition], detail
    # ... its old owner drained it before letting go: nothing of a lower epoch after the
    # fence, and no attempt lost in the hand-over.
    assert phase.late_writes == 0, detail
    assert phase.attempts_lost == 0, detail


@pytest.mark.parametrize("protocol", GROUP_PROTOCOLS)
async def test_workers_joining_and_leaving_move_only_the_partitions_that_change_hands(
    kafka_broker: Broker, tmp_path: Path, protocol: str
) -> None:
    report = await run_scenario(kafka_settings(kafka_broker), tmp_path, protocol)
    assert [p.name for p in report.phases] == list(MOVING)
    for phase in report.phases:
        _check(phase)
    for phase, others in zip(report.phases, (1, 2, 2, 1), strict=True):
        givers = {old for old, _new in phase.moved.values()}
        takers = {new for _old, new in phase.moved.values()}
        if phase.name.startswith("join"):  # all to the newcomer, from each of the others
            assert (len(takers), len(givers)) == (1, others), phase
        else:  # all from the leaver, to each of the others
            assert (len(givers), len(takers)) == (1, others), phase
    # Every acknowledged command applied once: each start, each event, each step.
    assert len(report.gates) == GATES
    assert report.wrong_results == []
    assert report.applied_twice == []
    assert report.duplicate_successes == []


async def test_a_worker_refused_by_a_group_of_eager_workers_says_why_and_takes_nothing(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = kafka_settings(kafka_broker)
    await asyncio.to_thread(create_topics, settings, 2)
    topics = TopicNames(settings.prefix)
    # A member as the workers of an older stepstream were: eager, on both topics.
    old = Consumer(
        {
            "bootstrap.servers": settings.bootstrap,
            "group.id": keys.group_id(settings.prefix),
            "partition.assignment.strategy": "range",
            "session.timeout.ms": 2000,
            "heartbeat.interval.ms": 300,
            "log_level": 3,
        }
    )
    assigned = threading.Event()
    stop = threading.Event()
    old.subscribe(
        [topics.name(COMMANDS), topics.name(TIMERS)],
        on_assign=lambda _c, parts: assigned.set() if parts else None,
    )

    def poll() -> None:
        while not stop.is_set():
            old.poll(0.05)
        old.close()

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    assert await asyncio.to_thread(assigned.wait, 30), "the eager member never got partitions"
    log = tmp_path / "worker.log"
    worker = WorkerProcess(settings, tmp_path / "w", tmp_path, log)
    view = await MembersView.open(
        topics.name(MEMBERS), timeout=10, **aiokafka_options(settings, "consumer")
    )
    try:
        await asyncio.to_thread(worker.start)
        deadline = time.monotonic() + 30
        while "workers of an older stepstream version" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            await asyncio.sleep(0.1)
        assert "stop all of them" in log.read_text().lower()
        # It stays out of the group rather than sharing partitions with it. (Once the
        # eager members are gone a Kafka broker lets it in; Tansu 0.6.0 keeps refusing
        # the group's new protocol: docs/kafka-notes.md, c.)
        assert view.owner(0) is None and view.owner(1) is None
        assert worker.proc is not None and worker.proc.poll() is None
    finally:
        stop.set()
        worker.stop()
        await view.close()
