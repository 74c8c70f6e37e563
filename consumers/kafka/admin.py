"""Creating and checking the topics of one prefix.

``<prefix>.commands``, ``.history``, ``.timers`` and ``.dead-letters`` have the same
partition count (they are co-partitioned: an instance lives on partition
``murmur2(id) % n`` of each); ``.members`` is a small compacted topic where workers
announce what they own, ``.definitions`` one where they register the workflows they run.
The settings each topic is created with, and why, are in ``topic_rules``. Partition
counts cannot change later (the partition of an instance is a function of the count).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from stepstream.consumers.kafka.clients import Refusals, make_client
from stepstream.consumers.kafka.topic_rules import CLUSTER_TOPICS, topic_config
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.topics import TOPIC_KINDS, TopicNames

ADMIN_REQUIRED: dict[str, object] = {"allow.auto.create.topics": False}


class TopicsMismatch(StepstreamError):
    """Existing topics do not have the partition counts stepstream needs."""


class TopicsMissing(StepstreamError):
    """A topic stepstream needs does not exist."""


@dataclass(frozen=True, slots=True)
class TopicState:
    name: str
    partitions: int
    created: bool


# librdkafka's own log lines at critical level only: an admin client that cannot reach
# the cluster would print an error line per attempt (about 20 a second) before the error
# that says what to do (``--kafka-opt admin.log_level=7`` shows them again).
ADMIN_DEFAULTS: dict[str, object] = {"log_level": 2}


def admin_client(settings: KafkaSettings, refusals: Refusals | None = None) -> AdminClient:
    required = {**ADMIN_REQUIRED, "error_cb": refusals} if refusals else ADMIN_REQUIRED
    config: dict[str, Any] = settings.client_config("admin", ADMIN_DEFAULTS, required)
    return make_client(AdminClient, config, "admin client")


# A metadata request is asked again after this long, and the refusals heard meanwhile
# checked: a wrong password fails in about a second, not after the whole timeout.
_METADATA_SLICE_S = 1.0


def cluster_metadata(settings: KafkaSettings, timeout: float = 10.0) -> tuple[AdminClient, Any]:
    """An admin client and the cluster's metadata (every topic), asked with it. Raises
    ``KafkaAuthenticationFailed`` once the cluster refuses the login or the TLS handshake
    fails, ``StepstreamError`` if it does not answer within ``timeout``."""
    refusals = Refusals()
    client = admin_client(settings, refusals)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return client, client.list_topics(timeout=max(0.1, min(_METADATA_SLICE_S, left)))
        except KafkaException as exc:
            client.poll(0)  # serves the error callback
            refusals.raise_if_refused(settings.bootstrap)
            if time.monotonic() >= deadline:
                raise StepstreamError(
                    f"cannot reach Kafka at {settings.bootstrap} within {timeout:.0f} s: {exc}; "
                    "check --bootstrap and the security settings"
                ) from None


def existing_partitions(settings: KafkaSettings, timeout: float = 10.0) -> dict[str, int]:
    """Partition counts of the prefix's topics that exist. Never creates a topic."""
    names = TopicNames(settings.prefix)
    wanted = {names.name(kind) for kind in (*TOPIC_KINDS, *CLUSTER_TOPICS)}
    _, metadata = cluster_metadata(settings, timeout)
    return {
        name: len(topic.partitions)
        for name, topic in metadata.topics.items()
        if name in wanted and topic.error is None
    }


def create_topics(
    settings: KafkaSettings,
    partitions: int,
    *,
    replication: int = 1,
    min_insync: int | None = None,
    timeout: float = 30.0,
) -> list[TopicState]:
    """Create whatever is missing; idempotent. Raises ``TopicsMismatch`` if a topic
    exists with another partition count. ``min_insync`` defaults to 2 from 3 replicas,
    else 1 (set on the topic: a broker's own default of 2 would refuse every write to a
    topic of one replica)."""
    if partitions < 1:
        raise StepstreamError(f"--partitions must be at least 1, got {partitions}")
    if replication < 1:
        raise StepstreamError(f"--replication-factor must be at least 1, got {replication}")
    if min_insync is None:
        min_insync = 2 if replication >= 3 else 1
    if min_insync is not None and not 1 <= min_insync <= replication:
        raise StepstreamError(
            f"--min-insync {min_insync} must be between 1 and the replication factor "
            f"({replication}): above it every write would be refused"
        )
    names = TopicNames(settings.prefix)
    wanted = {names.name(kind): partitions for kind in TOPIC_KINDS}
    wanted.update({names.name(kind): 1 for kind in CLUSTER_TOPICS})
    existing = existing_partitions(settings)
    _check_counts(settings, existing, wanted)
    missing = [name for name in wanted if name not in existing]
    created: set[str] = set()
    if missing:
        admin = admin_client(settings)
        new = [
            NewTopic(
                name,
                wanted[name],
                replication,
                config=topic_config(name[len(settings.prefix) + 1 :], min_insync),
            )
            for name in missing
        ]
        futures: dict[str, Future[None]] = admin.create_topics(new, request_timeout=timeout)
        for name, future in futures.items():
            try:
                future.result()
                created.add(name)
            except KafkaException as exc:
                error = exc.args[0]
                if (
                    isinstance(error, KafkaError)
                    and error.code() == KafkaError.TOPIC_ALREADY_EXISTS
                ):
                    continue  # another process created it meanwhile
                raise StepstreamError(f"cannot create topic {name}: {exc}") from None
        existing = existing_partitions(settings)
        _check_counts(settings, existing, wanted)
    return [
        TopicState(name, existing.get(name, count), name in created)
        for name, count in wanted.items()
    ]


def topic_partitions(settings: KafkaSettings) -> int:
    """The partition count of the prefix's co-partitioned topics, checked."""
    names = TopicNames(settings.prefix)
    existing = existing_partitions(settings)
    missing = [
        names.name(kind)
        for kind in (*TOPIC_KINDS, *CLUSTER_TOPICS)
        if names.name(kind) not in existing
    ]
    if missing:
        raise TopicsMissing(
            f"topics {', '.join(missing)} do not exist on {settings.bootstrap}; create them "
            f"with `stepstream topics create --bootstrap {settings.bootstrap} --prefix "
            f"{settings.prefix} --partitions N`"
        )
    counts = {existing[names.name(kind)] for kind in TOPIC_KINDS}
    if len(counts) != 1:
        raise TopicsMismatch(
            "the topics of prefix "
            f"{settings.prefix} have different partition counts "
            f"({', '.join(f'{names.name(k)}={existing[names.name(k)]}' for k in TOPIC_KINDS)}); "
            "they must be co-partitioned: recreate them with one count"
        )
    return counts.pop()


def _check_counts(
    settings: KafkaSettings, existing: dict[str, int], wanted: dict[str, int]
) -> None:
    wrong = [
        f"{name} has {existing[name]} partitions, not {count}"
        for name, count in wanted.items()
        if name in existing and existing[name] != count
    ]
    if wrong:
        raise TopicsMismatch(
            f"existing topics of prefix {settings.prefix} do not match: {'; '.join(wrong)}. "
            "Partition counts cannot change (an instance's partition depends on them): use "
            "the existing count, or another --prefix"
        )
