"""A consumer group's lag per partition, as the brokers know it: the offset the group
committed, the partition's end, the difference, and the member that owns it. Read with
the admin API only (the group coordinator's committed offsets and member assignments,
the partition leaders' end offsets), so it answers with every worker down, and it says
what Kafka's own ``kafka-consumer-groups --describe`` says.

The workers' group (``<prefix>.workers``) is assigned the commands topic only; a worker
fetches timers partition *p* with commands partition *p*, so its timers partitions are
shown with the owner of the commands partition. A worker commits its group's offsets
after the state that covers them is written, a few times a second; the lag shown is
therefore at least what it has not yet applied, never less.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._listoffsets import OffsetSpec

from stepstream.consumers.kafka import keys
from stepstream.consumers.kafka.admin import admin_client
from stepstream.consumers.kafka.clients import through_elections
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.topics import COMMANDS, TIMERS, TopicNames


class GroupNotFound(StepstreamError):
    """No consumer group of that name has members or committed offsets."""


@dataclass(frozen=True, slots=True)
class PartitionLag:
    topic: str
    partition: int
    committed: int | None  # the group's committed offset (None: never committed)
    end: int  # the partition's end offset (the next record's)
    lag: int | None  # end - committed
    member: str | None  # the owning member's id, client id and host (None: unowned)
    client_id: str | None
    host: str | None


@dataclass(frozen=True, slots=True)
class GroupLag:
    group: str
    state: str  # the coordinator's view: stable, preparing_rebalance, empty...
    protocol: str  # classic or consumer (KIP-848)
    assignor: str
    members: int
    partitions: list[PartitionLag]

    @property
    def total(self) -> int:
        return sum(p.lag or 0 for p in self.partitions)

    def as_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "state": self.state,
            "protocol": self.protocol,
            "assignor": self.assignor,
            "members": self.members,
            "total_lag": self.total,
            "partitions": [asdict(p) for p in self.partitions],
        }


def group_lag(settings: KafkaSettings, group: str | None = None, timeout: float = 15.0) -> GroupLag:
    """The lag of ``group`` (default: the workers' group of ``settings.prefix``)."""
    name = group or keys.group_id(settings.prefix)
    client = admin_client(settings)
    try:
        return _group_lag(client, settings, name, group is None, timeout)
    except KafkaException as exc:
        raise StepstreamError(
            f"cannot read consumer group {name} at {settings.bootstrap}: {exc.args[0]}; check "
            "--bootstrap, the security settings and that the principal may describe the group"
        ) from None


def _group_lag(
    client: AdminClient, settings: KafkaSettings, name: str, workers: bool, timeout: float
) -> GroupLag:
    # A coordinator that is moving or still loading (a cluster just started) answers again.
    described = through_elections(
        lambda: client.describe_consumer_groups([name], request_timeout=timeout)[name].result(),
        f"describing consumer group {name}",
        deadline_s=timeout,
    )
    owners: dict[tuple[str, int], Any] = {}
    for member in described.members:
        for tp in member.assignment.topic_partitions:
            owners[(tp.topic, tp.partition)] = member
    request = [ConsumerGroupTopicPartitions(name)]
    listed = through_elections(
        lambda: client.list_consumer_group_offsets(request, request_timeout=timeout)[name].result(),
        f"reading the committed offsets of consumer group {name}",
        deadline_s=timeout,
    )
    committed = {
        (tp.topic, tp.partition): tp.offset
        for tp in listed.topic_partitions or []
        if tp.error is None
    }
    wanted = set(committed) | set(owners)
    topics = TopicNames(settings.prefix)
    if workers:
        # Every partition of the workers' topics, committed to or not.
        metadata = client.list_topics(timeout=timeout)
        for kind in (COMMANDS, TIMERS):
            meta = metadata.topics.get(topics.name(kind))
            if meta is not None and meta.error is None:
                wanted |= {(topics.name(kind), p) for p in meta.partitions}
    if not described.members and not committed:
        raise GroupNotFound(
            f"consumer group {name} has no members and no committed offsets at "
            f"{settings.bootstrap}: "
            + (
                f"no worker of prefix {settings.prefix} has joined yet (start one with "
                f"stepstream worker --prefix {settings.prefix}), or pass the right --prefix"
                if workers
                else "check the name (kafka-consumer-groups --list shows the groups)"
            )
        )
    ends = _end_offsets(client, sorted(wanted), timeout)
    commands = topics.name(COMMANDS)
    rows: list[PartitionLag] = []
    for topic, partition in sorted(wanted):
        owner = owners.get((topic, partition))
        if owner is None and workers and topic == topics.name(TIMERS):
            owner = owners.get((commands, partition))
        offset = committed.get((topic, partition))
        done = offset if offset is not None and offset >= 0 else None
        end = ends[(topic, partition)]
        rows.append(
            PartitionLag(
                topic,
                partition,
                done,
                end,
                None if done is None else max(0, end - done),
                owner.member_id if owner is not None else None,
                owner.client_id if owner is not None else None,
                owner.host if owner is not None else None,
            )
        )
    return GroupLag(
        name,
        _enum_name(described.state),
        _enum_name(getattr(described, "type", "unknown")),
        described.partition_assignor or "",
        len(described.members),
        rows,
    )


def _end_offsets(
    client: AdminClient, partitions: list[tuple[str, int]], timeout: float
) -> dict[tuple[str, int], int]:
    if not partitions:
        return {}
    latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
    specs = {TopicPartition(t, p): latest for t, p in partitions}

    def ends() -> dict[tuple[str, int], int]:
        futures = client.list_offsets(specs, request_timeout=timeout)
        return {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}

    return through_elections(ends, "reading the ends of the group's partitions", deadline_s=timeout)


def _enum_name(value: Any) -> str:
    return str(getattr(value, "name", value)).lower()
