"""Three workers joining a group one by one and two of them leaving one by one, 12
partitions, with a workload on every partition and commands sent throughout: which
partitions changed hands, what each worker's group consumer was assigned and revoked,
how long each hand-over took, and how long the partitions that stayed went without
writing history meanwhile. On either group protocol (classic or KIP-848's consumer).

Everything is read from the topics: ``<prefix>.members`` says who owns what, and the
history topic (each record with the time its writer produced it) says when each
partition last wrote under its old owner, when the new owner fenced it, and whether a
partition that stayed was fenced again (taken over anew) or went quiet.

``tests/faults/test_kafka_rebalance.py`` asserts on the report; run as a script it prints
the figures of docs/kafka-notes.md ("Cooperative rebalancing")::

    python -m tests.rebalance_probe --runs 3 [--protocol consumer]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from stepstream.consumers.kafka import create_topics, keys
from stepstream.consumers.kafka.admin import admin_client
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.wire.records import (
    PartitionFenced,
    Record,
    StepAttemptStarted,
    StepFailedRecord,
    StepSucceeded,
    WaitSatisfied,
    WorkflowCompleted,
    WorkflowStarted,
)
from stepstream.engine.wire.serde import default_serde
from stepstream.engine.wire.topics import HISTORY, MEMBERS, TopicNames, partition_for
from stepstream.producers.client import Client
from stepstream.producers.kafka import aiokafka_options
from stepstream.producers.kafka.members import MembersView
from tests.conftest import KAFKA_TEST_OPTIONS, kafka_settings, kafka_url
from tests.faults.test_kafka_failover import WorkerProcess, owned_by
from tests.kafka_broker import Broker, start_test_kafka

PARTITIONS = 12
PER_PARTITION = 2  # ticker instances on each partition
TICK_S = 0.05
BASELINE_MS = 1500  # before each change, for comparison: nothing moves in it


@dataclass(frozen=True, slots=True)
class Seen:
    partition: int
    time_ms: int  # when its writer produced it
    record: Record


class HistoryWatch:
    """Every record of the history topic, as it arrives (a consumer outside any group)."""

    def __init__(self, settings: KafkaSettings, partitions: int) -> None:
        self._consumer = Consumer(
            {
                "bootstrap.servers": settings.bootstrap,
                "group.id": f"{settings.prefix}.probe",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 20,
                "log_level": 3,
            }
        )
        topic = TopicNames(settings.prefix).name(HISTORY)
        self._consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        self._serde = default_serde()
        self._seen: list[Seen] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="history-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for msg in self._consumer.consume(500, 0.05):
                err = msg.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"reading history: {err.str()}")
                    continue
                seen = Seen(
                    msg.partition() or 0,
                    msg.timestamp()[1],
                    self._serde.decode(msg.value() or b""),
                )
                with self._lock:
                    self._seen.append(seen)

    def records(self) -> list[Seen]:
        with self._lock:
            return list(self._seen)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


@dataclass
class Phase:
    """What one membership change did."""

    name: str
    moved: dict[int, tuple[str, str]]  # partition -> (old owner, new owner)
    stayed: list[int]
    # Partitions that stayed but were fenced (taken over) again: should be none.
    stayed_refenced: list[int]
    # Partitions that stayed but that <prefix>.members showed unowned or owned by another
    # worker at some point of the change: should be none.
    stayed_reannounced: list[int]
    # Moved partitions: the epochs of the fences written in the phase (a take-over fences
    # twice with one epoch: restore, then the processor's start).
    new_fences: dict[int, list[int]]
    old_epochs: dict[int, int]
    # Moved: from its last record under the old owner to the new owner's fence, and to
    # the first step the new owner recorded.
    handover_s: dict[int, float]
    first_step_s: dict[int, float]
    # Stayed: history records written while the moved partitions had no owner, and the
    # longest time without a record during the phase (and before it, for comparison).
    stayed_records_in_handover: dict[int, int]
    stayed_max_gap_s: dict[int, float]
    baseline_max_gap_s: float
    # Records of a lower epoch written after a moved partition's new fence.
    late_writes: int
    attempts_lost: int
    seconds: float
    # Worker URL -> what its group consumer logged in the phase: "assigned", "revoked",
    # "lost" -> partitions.
    group_events: dict[str, dict[str, set[int]]] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        gaps = sorted(self.stayed_max_gap_s.values())
        return {
            "phase": self.name,
            "moved": sorted(self.moved),
            "handover_s": _spread(list(self.handover_s.values())),
            "first_step_after_s": _spread(list(self.first_step_s.values())),
            "stayed_max_gap_s": _spread(gaps),
            "baseline_max_gap_s": round(self.baseline_max_gap_s, 3),
            "membership_change_s": round(self.seconds, 2),
        }


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.2f}-{max(values):.2f}"


@dataclass
class Report:
    phases: list[Phase] = field(default_factory=list)
    duplicate_successes: list[tuple[str, str]] = field(default_factory=list)
    applied_twice: list[tuple[str, str]] = field(default_factory=list)
    gates: list[str] = field(default_factory=list)  # started and sent their event (acked)
    wrong_results: list[tuple[str, object]] = field(default_factory=list)


def analyse(
    name: str,
    seen: list[Seen],
    start_ms: int,
    end_ms: int,
    before: dict[int, str],
    after: dict[int, str],
    announced: list[dict[int, str]],
) -> Phase:
    """``announced``: the owners ``<prefix>.members`` showed, after each change of it
    during the phase."""
    by_partition: dict[int, list[Seen]] = {}
    for s in seen:
        by_partition.setdefault(s.partition, []).append(s)
    moved = {p: (before[p], after[p]) for p in before if after.get(p) != before[p]}
    stayed = sorted(p for p in before if p not in moved)

    def fences(p: int, lo: int, hi: int) -> list[Seen]:
        return [
            s
            for s in by_partition.get(p, [])
            if isinstance(s.record, PartitionFenced) and lo <= s.time_ms <= hi
        ]

    handover_s: dict[int, float] = {}
    first_step_s: dict[int, float] = {}
    new_fences: dict[int, list[int]] = {}
    old_epochs: dict[int, int] = {}
    windows: list[tuple[int, int]] = []
    late = 0
    for p in moved:
        records = by_partition.get(p, [])
        fenced = fences(p, start_ms, end_ms)
        new_fences[p] = sorted({f.record.epoch for f in fenced})
        earlier = [s for s in records if s.time_ms < start_ms]
        old_epochs[p] = max((s.record.epoch for s in earlier), default=0)
        if not fenced:
            continue
        fence = fenced[0]
        last_old = max(
            (
                s.time_ms
                for s in records
                if s.record.epoch < fence.record.epoch and s.time_ms <= fence.time_ms
            ),
            default=start_ms,
        )
        handover_s[p] = (fence.time_ms - last_old) / 1000
        windows.append((last_old, fence.time_ms))
        steps_after = [
            s.time_ms
            for s in records
            if s.time_ms >= fence.time_ms and isinstance(s.record, StepAttemptStarted)
        ]
        if steps_after:
            first_step_s[p] = (min(steps_after) - last_old) / 1000
        late += sum(
            1 for s in records if s.time_ms > fence.time_ms and s.record.epoch < fence.record.epoch
        )
    lo = min((w[0] for w in windows), default=start_ms)
    hi = max((w[1] for w in windows), default=end_ms)
    in_handover = {
        p: sum(1 for s in by_partition.get(p, []) if lo < s.time_ms < hi) for p in stayed
    }
    baseline_start = start_ms - BASELINE_MS
    return Phase(
        name=name,
        moved=moved,
        stayed=stayed,
        stayed_refenced=[p for p in stayed if fences(p, start_ms, end_ms)],
        stayed_reannounced=[p for p in stayed if any(o.get(p) != before[p] for o in announced)],
        new_fences=new_fences,
        old_epochs=old_epochs,
        handover_s=handover_s,
        first_step_s=first_step_s,
        stayed_records_in_handover=in_handover,
        stayed_max_gap_s={p: _max_gap(by_partition.get(p, []), start_ms, end_ms) for p in stayed},
        baseline_max_gap_s=max(
            (_max_gap(by_partition.get(p, []), baseline_start, start_ms) for p in before),
            default=0.0,
        ),
        late_writes=late,
        attempts_lost=sum(
            1
            for s in seen
            if start_ms <= s.time_ms <= end_ms
            and isinstance(s.record, StepFailedRecord)
            and s.record.error_type == "AttemptLost"
        ),
        seconds=(end_ms - start_ms) / 1000,
    )


def _max_gap(records: list[Seen], start_ms: int, end_ms: int) -> float:
    """The longest stretch of [start, end] without a record of the partition."""
    return _gap(records, start_ms, end_ms)[0]


def _gap(records: list[Seen], start_ms: int, end_ms: int) -> tuple[float, float]:
    """The longest stretch of [start, end] without a record of the partition, and when
    it began (seconds after start)."""
    times = sorted(s.time_ms for s in records if start_ms <= s.time_ms <= end_ms)
    marks = [start_ms, *times, end_ms]
    length, began = max((b - a, a) for a, b in itertools.pairwise(marks))
    return length / 1000, (began - start_ms) / 1000


def duplicate_successes(seen: list[Seen]) -> list[tuple[str, str]]:
    """(instance, step) that succeeded twice in the history every reader folds (records
    of a lower epoch after a fence are not part of it)."""
    fence: dict[int, int] = {}
    counts: Counter[tuple[str, str]] = Counter()
    for s in sorted(seen, key=lambda s: (s.partition, s.time_ms)):
        if isinstance(s.record, PartitionFenced):
            fence[s.partition] = max(fence.get(s.partition, 0), s.record.epoch)
        elif s.record.epoch >= fence.get(s.partition, 0) and isinstance(s.record, StepSucceeded):
            counts[(s.record.instance_id, s.record.key)] += 1
    return sorted(k for k, n in counts.items() if n > 1)


async def _owners(
    view: MembersView, expect: Callable[[dict[int, str]], bool], timeout: float = 60
) -> dict[int, str]:
    return await owned_by(view, PARTITIONS, expect, timeout)


def _balanced(urls: set[str]) -> Callable[[dict[int, str]], bool]:
    share = PARTITIONS // len(urls)

    def check(owners: dict[int, str]) -> bool:
        counts = Counter(owners.values())
        return len(owners) == PARTITIONS and set(counts) == urls and set(counts.values()) == {share}

    return check


GROUP_PROTOCOLS = ("classic", "consumer")
GATES = 40  # short workflows started (and their events sent) while the group changes
# The worker's log line, as its text format writes it (the partitions a field):
#   msg="group assigned partitions" partitions="[0, 1, 2]"
_GROUP_EVENT = re.compile(
    r'msg="group (assigned|revoked|lost) partitions[^"]*".*?partitions="\[([\d, ]*)\]"'
)


# On the consumer protocol a member hears of a change at its next heartbeat, at the
# interval the broker sets (5 s by default). The tests give the workers' group 1 s, a
# group config as an operator would set it, as classic members get 300 ms.
GROUP_HEARTBEAT_MS = 1000


def tune_group(settings: KafkaSettings, protocol: str, heartbeat_ms: int | None) -> None:
    """On the consumer protocol, set the workers' group's heartbeat interval (Kafka's
    ``consumer.heartbeat.interval.ms`` group config; ``kafka-configs --alter
    --entity-type groups``); None leaves the broker's. Classic members set their own."""
    if protocol != "consumer" or heartbeat_ms is None:
        return
    entry = ConfigEntry(
        "consumer.heartbeat.interval.ms",
        str(heartbeat_ms),
        incremental_operation=AlterConfigOpType.SET,
    )
    group = ConfigResource(
        ResourceType.GROUP, keys.group_id(settings.prefix), incremental_configs=[entry]
    )
    admin = admin_client(settings)  # kept until the answer: its futures die with it
    for done in admin.incremental_alter_configs([group]).values():
        done.result(timeout=30)


def worker_settings(protocol: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The workers' --kafka-opt options and environment for a group protocol: with KIP-848's
    the session timeout and heartbeat are the broker's, so the tests' shorter ones go."""
    if protocol == "classic":
        return KAFKA_TEST_OPTIONS, {}
    return (), {"STEPSTREAM_KAFKA_GROUP_PROTOCOL": protocol}


class GroupLog:
    """The partitions a worker's group consumer was assigned, revoked and lost, as its
    log says, from a mark on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mark = 0

    def mark(self) -> None:
        self._mark = self.path.stat().st_size if self.path.exists() else 0

    def since_mark(self) -> dict[str, set[int]]:
        events: dict[str, set[int]] = {"assigned": set(), "revoked": set(), "lost": set()}
        with open(self.path, "rb") as f:
            f.seek(self._mark)
            text = f.read().decode(errors="replace")
        for kind, listed in _GROUP_EVENT.findall(text):
            events[kind] |= {int(p) for p in listed.split(",") if p.strip()}
        return events


async def run_scenario(
    settings: KafkaSettings,
    workdir: Path,
    protocol: str = "classic",
    group_heartbeat_ms: int | None = GROUP_HEARTBEAT_MS,
) -> Report:
    """Three workers join one by one, then two of them leave one by one (SIGTERM), while
    tickers run on every partition and short workflows are started and sent events."""
    await asyncio.to_thread(create_topics, settings, PARTITIONS)
    await asyncio.to_thread(tune_group, settings, protocol, group_heartbeat_ms)
    ledger = workdir / "ledger"
    ledger.mkdir()
    options, env = worker_settings(protocol)
    workers = [
        WorkerProcess(
            settings,
            workdir / f"w{i}",
            ledger,
            workdir / f"w{i}.log",
            workflows="tests.fault_workflows",
            env=env,
            options=options,
        )
        for i in range(3)
    ]
    logs = [GroupLog(w.log) for w in workers]
    watch = HistoryWatch(settings, PARTITIONS)
    view = await MembersView.open(
        TopicNames(settings.prefix).name(MEMBERS),
        timeout=10,
        **aiokafka_options(settings, "consumer"),
    )
    report = Report()
    announced: list[dict[int, str]] = []
    view.on_change(
        lambda: announced.append(
            {p: m.url for p in range(PARTITIONS) if (m := view.owner(p)) is not None}
        )
    )
    members: list[WorkerProcess] = []
    try:
        await asyncio.to_thread(workers[0].start)
        members.append(workers[0])
        await _owners(view, _balanced({workers[0].url}))
        async with Client.connect(kafka_url(settings)) as client:
            for instance in _spread_ids(PER_PARTITION):
                await client.start(
                    "ticker", {"steps": 100_000, "seconds": TICK_S}, instance_id=instance
                )
            # Every partition is busy before anything changes.
            deadline = time.monotonic() + 60
            while {
                s.partition for s in watch.records() if isinstance(s.record, StepSucceeded)
            } != set(range(PARTITIONS)):
                assert time.monotonic() < deadline, "the workload never reached every partition"
                await asyncio.sleep(0.1)
            await asyncio.sleep(BASELINE_MS / 1000)
            gates = asyncio.create_task(_open_gates(client, report))

            async def change(name: str, act: Callable[[], None]) -> None:
                before = await _owners(view, lambda o: len(o) == PARTITIONS)
                for log in logs:
                    log.mark()
                start_ms = int(time.time() * 1000)
                announced.clear()
                await asyncio.to_thread(act)
                after = await _owners(view, _balanced({w.url for w in members}))
                # The new owners' first records, and the next phase's baseline.
                await asyncio.sleep(BASELINE_MS / 1000)
                end_ms = int(time.time() * 1000)
                phase = analyse(
                    name, watch.records(), start_ms, end_ms, before, after, list(announced)
                )
                phase.group_events = {
                    w.url: log.since_mark() for w, log in zip(workers, logs, strict=True) if w.url
                }
                report.phases.append(phase)

            for joining in workers[1:]:
                members.append(joining)
                await change(f"join {len(members)}", joining.start)
            for leaving in workers[:2]:
                members.remove(leaving)
                await change(f"leave {len(members) + 1}", leaving.stop)
            await gates
            await _check_gates(client, report)
        report.duplicate_successes = duplicate_successes(watch.records())
        report.applied_twice = applied_twice(watch.records())
    finally:
        for w in workers:
            w.kill()
        await view.close()
        watch.close()
    return report


def _spread_ids(per_partition: int) -> list[str]:
    """Instance ids, ``per_partition`` on each partition."""
    ids: list[str] = []
    for n in itertools.count():
        candidate = f"tick-{n}"
        mine = partition_for(candidate, PARTITIONS)
        if sum(partition_for(i, PARTITIONS) == mine for i in ids) < per_partition:
            ids.append(candidate)
        if len(ids) == PARTITIONS * per_partition:
            return ids
    raise AssertionError("unreachable")


async def _open_gates(client: Client, report: Report) -> None:
    """Start a gate and send it its event, again and again while the group changes: each
    command counts once the broker acknowledged it."""
    for n in range(GATES):
        instance = f"gate-{n}"
        await client.start("gate", None, instance_id=instance)
        await client.send_event(instance, "open", {"n": n}, event_id=f"open-{n}")
        report.gates.append(instance)
        await asyncio.sleep(0.25)


async def _check_gates(client: Client, report: Report) -> None:
    for n, instance in enumerate(report.gates):
        result = await client.result(instance, timeout=60)
        if result != {"n": n}:
            report.wrong_results.append((instance, result))


def applied_twice(seen: list[Seen]) -> list[tuple[str, str]]:
    """(instance, record type) of starts, completions and satisfied waits recorded more
    than once in the history every reader folds: a command applied twice."""
    fence: dict[int, int] = {}
    counts: Counter[tuple[str, str]] = Counter()
    once = (WorkflowStarted, WorkflowCompleted, WaitSatisfied)
    for s in sorted(seen, key=lambda s: (s.partition, s.time_ms)):
        if isinstance(s.record, PartitionFenced):
            fence[s.partition] = max(fence.get(s.partition, 0), s.record.epoch)
        elif s.record.epoch >= fence.get(s.partition, 0) and isinstance(s.record, once):
            counts[(s.record.instance_id, type(s.record).__name__)] += 1
    return sorted(k for k, n in counts.items() if n > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--protocol", choices=GROUP_PROTOCOLS, default="classic")
    parser.add_argument(
        "--group-heartbeat-ms",
        type=int,
        help="the consumer protocol's heartbeat for the group (default: the broker's, 5 s)",
    )
    args = parser.parse_args()
    broker: Broker = start_test_kafka()
    try:
        for run in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                scenario = run_scenario(
                    kafka_settings(broker), Path(tmp), args.protocol, args.group_heartbeat_ms
                )
                report = asyncio.run(scenario)
            for phase in report.phases:
                print(json.dumps({"run": run + 1, "protocol": args.protocol, **phase.summary()}))
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
