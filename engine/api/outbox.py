"""The outbox: ``ctx.publish`` produces a record to a user's Kafka topic as a durable step.

A publish is a step under the hood (replay key ``publish:<topic>`` unless named): its
``StepAttemptStarted`` is durable before the body produces, so the record goes out only
after the transition that reached it is durable; an attempt lost with its process is
retried; the acknowledged (partition, offset) is recorded and replay returns it without
producing again. The body produces until the broker acknowledges (retried for ever, the
backoff capped), so a record may be produced more than once; every copy carries the same
``stepstream-id`` header (``<instance id>/<replay key>``), and a consumer that drops the
ids it has seen sees each publish once.

The engine never imports Kafka: the step body finds the host's ``Outbox`` on its
attempt (``engine.api.attempts.current_flag``), which the step executor sets around every
body. A host without one (an embedded engine started without
``STEPSTREAM_OUTBOX_BOOTSTRAP``) fails the publish at once with an error naming the
variable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from stepstream.engine.api.attempts import current_flag
from stepstream.engine.api.retry import RetryPolicy
from stepstream.engine.errors import InvalidPayload, InvalidWorkflowCall, OutboxNotConfigured
from stepstream.engine.wire.codec import PayloadCodec, encode_safely

ID_HEADER = "stepstream-id"
ENV_BOOTSTRAP = "STEPSTREAM_OUTBOX_BOOTSTRAP"
NAME_PREFIX = "publish:"
# Until the broker acknowledges: a broker outage or a topic not created yet must not use
# the publish up; the cap keeps the next try close once it is back.
PUBLISH_RETRY = RetryPolicy(max_attempts=None, initial_interval=0.5, backoff=2.0, max_interval=30)
# What Kafka itself accepts as a topic name.
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")

Header = tuple[str, bytes]


@dataclass(frozen=True, slots=True)
class OutboxRecord:
    """One record to produce; the producer's partitioner picks its partition (murmur2
    of the key, as Java clients do)."""

    topic: str
    value: bytes
    key: bytes | None
    headers: tuple[Header, ...]
    id: str


class Outbox(Protocol):
    """Produces records to user topics; provided by the host (``consumers.kafka``)."""

    async def publish(self, record: OutboxRecord) -> tuple[int, int]:
        """Produce ``record`` and return its (partition, offset) once the broker
        acknowledged it (acks=all). Raises a retryable exception for a failure that may
        pass (the broker unreachable, the topic missing) and ``NonRetryableError`` for a
        record the broker will never take (too large)."""
        ...


class MemoryOutbox:
    """An ``Outbox`` that keeps what is published in ``records`` (one partition, offsets
    from 0), for tests (``stepstream.testing.WorkflowEnvironment``)."""

    def __init__(self) -> None:
        self.records: list[OutboxRecord] = []

    async def publish(self, record: OutboxRecord) -> tuple[int, int]:
        self.records.append(record)
        return 0, len(self.records) - 1


@dataclass(frozen=True, slots=True)
class Published:
    """What ``ctx.publish`` returns: where the record landed, and its ``stepstream-id``."""

    topic: str
    partition: int
    offset: int
    id: str


def topic_problem(topic: object) -> str | None:
    """Why ``topic`` cannot name a Kafka topic, or None."""
    if not isinstance(topic, str):
        return f"must be a string, not {type(topic).__name__}"
    if topic in (".", "..") or _TOPIC.fullmatch(topic) is None:
        return (
            "is not a valid Kafka topic name (1 to 249 characters of letters, digits, "
            "'.', '_' and '-', not '.' or '..')"
        )
    return None


def outbox_record(
    topic: str,
    value: Any,
    key: str | bytes | None,
    headers: dict[str, str | bytes] | None,
    *,
    codec: PayloadCodec,
) -> OutboxRecord:
    """The record ``ctx.publish`` asked for, without its id yet: checked and encoded in
    the workflow code, so bad input raises at the call (and on every replay alike)."""
    problem = topic_problem(topic)
    if problem is not None:
        raise InvalidWorkflowCall(f"ctx.publish: topic {topic!r} {problem}")
    return OutboxRecord(
        topic=topic,
        value=_value(topic, value, codec),
        key=_key(topic, key),
        headers=_headers(topic, headers),
        id="",
    )


def _value(topic: str, value: Any, codec: PayloadCodec) -> bytes:
    if isinstance(value, bytes):
        return value
    try:
        return encode_safely(codec, value).data
    except InvalidPayload as exc:
        raise InvalidPayload(
            f"ctx.publish to {topic!r}: the value cannot be encoded ({exc}); publish "
            "bytes, or a value the payload codec takes (JSON by default)"
        ) from None


def _key(topic: str, key: object) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    raise InvalidWorkflowCall(
        f"ctx.publish to {topic!r}: key must be str, bytes or None, not {type(key).__name__}"
    )


def _headers(topic: str, headers: object) -> tuple[Header, ...]:
    if headers is None:
        return ()
    if not isinstance(headers, dict):
        raise InvalidWorkflowCall(
            f"ctx.publish to {topic!r}: headers must be a dict of str to str or bytes, not "
            f"{type(headers).__name__}"
        )
    out: list[Header] = []
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise InvalidWorkflowCall(
                f"ctx.publish to {topic!r}: header names must be non-empty strings, not {name!r}"
            )
        if name.lower() == ID_HEADER:
            raise InvalidWorkflowCall(
                f"ctx.publish to {topic!r}: the header {ID_HEADER!r} is stepstream's own (the "
                "id consumers drop duplicates by); give yours another name"
            )
        if isinstance(value, str):
            out.append((name, value.encode()))
        elif isinstance(value, bytes):
            out.append((name, value))
        else:
            raise InvalidWorkflowCall(
                f"ctx.publish to {topic!r}: header {name!r} must be str or bytes, not "
                f"{type(value).__name__}"
            )
    return tuple(out)


async def publish_body(record: OutboxRecord) -> dict[str, Any]:
    """The step body of a publish: produce with the host's outbox, return where the
    record landed (recorded, so replay returns it)."""
    flag = current_flag.get()
    outbox = None if flag is None else flag.outbox
    if outbox is None:
        raise OutboxNotConfigured(
            f"ctx.publish to {record.topic!r}: this engine has no Kafka cluster to publish "
            f"to; set {ENV_BOOTSTRAP}=HOST:PORT (client properties from STEPSTREAM_KAFKA_*) "
            "and restart it (a Kafka worker publishes to its own cluster by default)"
        )
    partition, offset = await outbox.publish(record)
    return {"topic": record.topic, "partition": partition, "offset": offset, "id": record.id}


def published(value: dict[str, Any]) -> Published:
    return Published(
        topic=str(value["topic"]),
        partition=int(value["partition"]),
        offset=int(value["offset"]),
        id=str(value["id"]),
    )
