"""The Kafka side of the outbox (``engine.api.outbox``): the producer ``ctx.publish`` bodies
share, one per process, made on the first publish.

It is idempotent with acks=all, like the log's producer, but its own: a user topic that
is missing, refuses a record or breaks the producer never touches the commits of the
engine. Unlike the log's, its records time out (``message.timeout.ms``, 30 s unless set
with ``producer.message.timeout.ms``): a failed attempt says why (the cluster
unreachable, the topic missing) and the step retries it with backoff, instead of an
attempt that waits silently for ever. User topics are never created here.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from confluent_kafka import KafkaError

from stepstream.consumers.kafka.producer import (
    PRODUCER_DEFAULTS,
    PRODUCER_REQUIRED,
    LogProducer,
    OutRecord,
    ProduceFailed,
)
from stepstream.engine.api.outbox import ID_HEADER, OutboxRecord
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.errors import NonRetryableError

log = logging.getLogger("stepstream.outbox")

OUTBOX_DEFAULTS: dict[str, object] = {**PRODUCER_DEFAULTS, "message.timeout.ms": 30_000}
OUTBOX_REQUIRED: dict[str, object] = {
    k: v for k, v in PRODUCER_REQUIRED.items() if k != "message.timeout.ms"
}
# What the broker will refuse again however often the record is sent.
_REFUSED = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.INVALID_RECORD,
    }
)
# After these the producer's idempotence state (producer id, epoch, sequence numbers) may
# be one the broker no longer takes: a message timed out in flight makes librdkafka bump
# its epoch, which not every Kafka-protocol broker accepts (Tansu answers PRODUCER_FENCED
# for ever). A fresh producer starts clean; the id header makes any repeat harmless.
_STALE = frozenset(
    {
        KafkaError._MSG_TIMED_OUT,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.PRODUCER_FENCED,
        KafkaError.UNKNOWN_PRODUCER_ID,
        KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    }
)
_ANY_PARTITION = -1  # the partitioner picks: murmur2 of the key
_MESSAGE_TIMEOUT = "message.timeout.ms"


class KafkaOutbox:
    """``engine.api.outbox.Outbox`` on a Kafka cluster; ``close()`` flushes and stops."""

    def __init__(self, settings: KafkaSettings, *, client_id: str = "stepstream-outbox") -> None:
        self._settings = settings
        self._client_id = client_id
        self._producer: LogProducer | None = None
        self._closed = False
        # Every record must get its delivery report within a bounded time, or a publish
        # could wait for ever (a retired producer is closed once they all have theirs).
        timeout_ms = _message_timeout_ms(
            settings.client_config("producer", OUTBOX_DEFAULTS, OUTBOX_REQUIRED)
        )
        self._required = {**OUTBOX_REQUIRED, _MESSAGE_TIMEOUT: timeout_ms}
        self._timeout_s = timeout_ms / 1000
        self._retiring: list[threading.Thread] = []

    @property
    def bootstrap(self) -> str:
        return self._settings.bootstrap

    def _ready(self) -> LogProducer:
        if self._closed:
            raise ProduceFailed("the outbox is closed (the engine is stopping)")
        producer = self._producer
        if producer is not None and producer.failed is not None:
            self._retire(producer, f"it failed for good: {producer.failed}")
            producer = None
        if producer is None:
            producer = self._producer = LogProducer(
                self._settings,
                client_id=self._client_id,
                defaults=OUTBOX_DEFAULTS,
                required=self._required,
            )
        return producer

    async def publish(self, record: OutboxRecord) -> tuple[int, int]:
        producer = self._ready()
        headers: list[tuple[str, str | bytes | None]] = [(ID_HEADER, record.id.encode())]
        headers.extend(record.headers)
        out = OutRecord(record.topic, _ANY_PARTITION, record.key, record.value, headers)
        try:
            return await producer.send_one(out)
        except ProduceFailed as exc:
            if exc.code in _REFUSED:
                raise NonRetryableError(
                    f"Kafka refuses the record for {record.topic!r} for good: {exc}"
                ) from None
            missing = exc.code == KafkaError._MSG_TIMED_OUT and await asyncio.to_thread(
                producer.topic_missing, record.topic, 2.0
            )
            if exc.code in _STALE:
                self._retire(producer, str(exc))
            if missing:
                raise ProduceFailed(
                    f"topic {record.topic!r} does not exist on {self.bootstrap}: create it "
                    "(stepstream does not create your topics); the publish is tried again "
                    "until it is acknowledged",
                    code=exc.code,
                ) from None
            if exc.code == KafkaError._MSG_TIMED_OUT:
                raise ProduceFailed(
                    f"{self.bootstrap} did not acknowledge the record for {record.topic!r} "
                    f"within {_MESSAGE_TIMEOUT} ({self._timeout_s:g} s): is the cluster "
                    "reachable? The publish is tried again until it is acknowledged",
                    code=exc.code,
                ) from None
            raise

    def _retire(self, producer: LogProducer, why: str) -> None:
        if self._producer is not producer:
            return  # replaced already (by a publish that failed alongside)
        log.warning("replacing the outbox producer after: %s", why)
        self._producer = None
        closing = threading.Thread(
            target=producer.close,
            args=(self._timeout_s + 5.0,),
            name="stepstream-outbox-retire",
            daemon=True,
        )
        closing.start()
        self._retiring.append(closing)
        self._retiring = [t for t in self._retiring if t.is_alive()]

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is queued (up to ``timeout`` seconds) and stop. Blocking. A record
        left unacknowledged belongs to an attempt that was given up: retried later."""
        self._closed = True
        if self._producer is not None:
            self._producer.close(timeout)
            self._producer = None
        for closing in self._retiring:
            closing.join(timeout)
        self._retiring = []


def _message_timeout_ms(config: dict[str, object]) -> int:
    default = int(str(OUTBOX_DEFAULTS[_MESSAGE_TIMEOUT]))
    try:
        value = int(str(config[_MESSAGE_TIMEOUT]))
    except ValueError:
        value = 0
    if value <= 0:
        log.warning(
            "the outbox needs a positive producer.message.timeout.ms (got %r): using %d ms",
            config[_MESSAGE_TIMEOUT],
            default,
        )
        return default
    return value
