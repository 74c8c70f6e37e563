"""The worker's one Kafka producer, shared by every partition it owns.

``send`` hands a whole commit's records to librdkafka at once and resolves when every one
of them is acknowledged (acks=all), so records of many instances and partitions share
produce requests and nobody waits for one record alone. Delivery reports are served by
a dedicated thread that polls the producer and wakes the event loop once per commit.

The producer is idempotent: within a partition records land in the order they were
produced, without duplicates from retries, so the history a restore reads is always a
prefix of what was produced; and messages never time out (a broker outage stalls
commits instead of leaving gaps).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from functools import partial

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from stepstream.consumers.kafka.clients import make_client
from stepstream.consumers.kafka.librdkafka_log import SameLineLimit, quiet_librdkafka
from stepstream.consumers.kafka.logins import LoginWatch
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.values import value

log = logging.getLogger("stepstream.kafka.producer")

PRODUCER_DEFAULTS: dict[str, object] = {
    "linger.ms": 0,
    "compression.type": "none",
    "partitioner": "murmur2_random",
    "message.max.bytes": 4 * 1024 * 1024,
}
PRODUCER_REQUIRED: dict[str, object] = {
    "acks": "all",
    "enable.idempotence": True,
    "message.timeout.ms": 0,
    "allow.auto.create.topics": False,
}
# How often a watched producer's statistics say whether it is connected (logged in).
LOGIN_STATS_INTERVAL_MS = 1000


class ProduceFailed(StepstreamError):
    """A record could not be written to Kafka; what was produced before it may be there.
    ``code``: librdkafka's error code, when Kafka said why."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


@value
class OutRecord:
    topic: str
    partition: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, str | bytes | None]] | None = None


class _Delivery:
    """The delivery reports of one ``send``; counted on the producer's poll thread."""

    __slots__ = ("code", "error", "future", "loop", "offsets", "partitions", "remaining")

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        self.loop = loop
        self.future: asyncio.Future[list[int]] = loop.create_future()
        self.offsets = [-1] * count
        self.partitions = [-1] * count
        self.remaining = count
        self.error: str | None = None
        self.code: int | None = None

    def delivered(self, index: int, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            if self.error is None:
                self.error = f"{msg.topic()}[{msg.partition()}]: {err.str()}"
                self.code = err.code()
        else:
            self.offsets[index] = msg.offset() or 0
            self.partitions[index] = msg.partition() or 0
        self.remaining -= 1
        if self.remaining == 0:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self.loop.call_soon_threadsafe(self._finish)

    def _finish(self) -> None:
        if self.future.done():
            return  # the sender was cancelled; the records are in Kafka regardless
        if self.error is not None:
            self.future.set_exception(
                ProduceFailed(f"Kafka refused a record: {self.error}", code=self.code)
            )
        else:
            self.future.set_result(self.offsets)


class _Errors:
    """librdkafka's error callback; kept apart from ``LogProducer`` so the producer handle
    does not hold its owner (a cycle would keep the handle, and its connections, alive
    until the cyclic collector runs)."""

    def __init__(self, logins: LoginWatch | None) -> None:
        self.fatal: str | None = None
        self.logins = logins
        self._repeats = SameLineLimit()

    def __call__(self, err: KafkaError) -> None:
        logins = self.logins
        if logins is not None and logins.refused("producer", err):
            return  # reported there, once; the records wait in the queue
        if logins is not None and logins.failing and err.code() == KafkaError._ALL_BROKERS_DOWN:
            return  # the refused login, again
        if err.fatal():
            self.fatal = err.str()
            log.error("Kafka producer failed for good: %s", err.str())
        elif err.code() != KafkaError._TRANSPORT and self._repeats.fresh(err.str()):
            # (A reconnect is routine; librdkafka logs it.)
            log.warning("Kafka producer error: %s", err.str())

    def statistics(self, stats: str) -> None:
        if self.logins is not None and self.logins.failing:  # else nothing to learn
            with contextlib.suppress(ValueError):
                self.logins.statistics("producer", json.loads(stats))


class LogProducer:
    def __init__(
        self,
        settings: KafkaSettings,
        *,
        client_id: str = "stepstream-worker",
        defaults: Mapping[str, object] = PRODUCER_DEFAULTS,
        required: Mapping[str, object] = PRODUCER_REQUIRED,
        logins: LoginWatch | None = None,
    ) -> None:
        """``defaults`` and ``required``: see ``KafkaSettings.client_config`` (the log's
        own settings unless given: the outbox's differ). ``logins`` hears of a login the
        cluster refuses while it runs (and of the producer logged in again)."""
        self._errors = _Errors(logins)
        # librdkafka's lines go through logging (the process's format, JSON with the
        # rest) whoever owns the producer: a worker, or an engine's outbox.
        watched: dict[str, object] = {"logger": quiet_librdkafka()}
        if logins is not None:
            watched["statistics.interval.ms"] = LOGIN_STATS_INTERVAL_MS
            watched["stats_cb"] = self._errors.statistics
        config = settings.client_config(
            "producer",
            {**defaults, "client.id": client_id},
            {**required, "error_cb": self._errors, **watched},
        )
        self._producer = make_client(Producer, config, "producer")
        self._closed = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._poll, name="stepstream-kafka-producer", daemon=True
        )
        self._thread.start()

    async def send(self, records: Sequence[OutRecord]) -> list[int]:
        """Produce ``records`` (in order within each partition) and return their offsets
        once all are acknowledged. Raises ``ProduceFailed`` if any was refused."""
        if not records:
            return []
        return (await self._send(records)).offsets

    async def send_one(self, record: OutRecord) -> tuple[int, int]:
        """Produce one record (a partition of -1: the partitioner picks it) and return
        its (partition, offset) once it is acknowledged."""
        delivery = await self._send([record])
        return delivery.partitions[0], delivery.offsets[0]

    def topic_missing(self, topic: str, timeout: float = 5.0) -> bool:
        """Whether the cluster says ``topic`` does not exist (asking does not create it:
        topics are not auto-created). Blocking."""
        try:
            metadata = self._producer.list_topics(topic, timeout=timeout)
        except KafkaException:
            return False  # cannot tell (the cluster is unreachable)
        found = metadata.topics.get(topic)
        return found is None or (
            found.error is not None and found.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
        )

    async def _send(self, records: Sequence[OutRecord]) -> _Delivery:
        if self._closed:
            raise ProduceFailed("the worker's Kafka producer is closed")
        if self._errors.fatal is not None:
            raise ProduceFailed(f"the Kafka producer failed for good: {self._errors.fatal}")
        delivery = _Delivery(asyncio.get_running_loop(), len(records))
        produce = self._producer.produce
        for index, record in enumerate(records):
            while True:
                try:
                    produce(
                        record.topic,
                        record.value,
                        record.key,
                        partition=record.partition,
                        headers=record.headers,
                        on_delivery=partial(delivery.delivered, index),
                    )
                    break
                except BufferError:
                    # librdkafka's queue is full: wait for acknowledgements to drain it.
                    await asyncio.sleep(0.005)
                except KafkaException as exc:
                    raise ProduceFailed(
                        f"cannot produce to {record.topic}[{record.partition}]: {exc}",
                        code=exc.args[0].code() if exc.args else None,
                    ) from None
        await delivery.future
        return delivery

    @property
    def failed(self) -> str | None:
        """Why the producer cannot be used any more, or None."""
        return self._errors.fatal

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is queued (up to ``timeout`` seconds) and stop. Blocking."""
        if self._closed:
            return
        self._closed = True
        remaining = self._producer.flush(timeout)
        if remaining:
            log.warning("closing the producer with %d records not acknowledged", remaining)
            self._producer.purge()  # dropped: closing must not wait for them for ever
        self._stopping.set()
        self._thread.join()
        # Destroys the handle now, and its connections with it, even while something
        # still refers to it (the frame of a send that was cancelled mid-wait): a handle
        # left alive reconnects to its brokers for as long as the process lives.
        self._producer.close()
        del self._producer

    def _poll(self) -> None:
        poll = self._producer.poll
        while not self._stopping.is_set():
            poll(0.1)
