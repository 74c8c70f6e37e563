"""How a ``kafka://`` client publishes its commands: librdkafka's producer (confluent-kafka).

librdkafka sends from threads of its own, outside the GIL, as soon as a record is handed
to it (after ``linger.ms``). A client that starts many instances at once therefore has
its first commands on the broker while its event loop is still making the rest, and the
broker stamps each produce request's time as it comes. With aiokafka, whose sender is a
task on the same loop, nothing left before the whole burst had been made: 2,000 starts
at once went in one request per partition, each sharing one broker timestamp, so their
sleeps fell due in the same millisecond (docs/performance.md, "W2 as a client sees it").

Delivery reports are served by one thread that polls the producer and wakes the event
loop once per poll with every report it served. Records are acknowledged by all in-sync
replicas (acks=all) and the producer is idempotent: a retried request neither loses nor
repeats a command, and a partition's commands land in the order they were published.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from stepstream.engine.config.kafka import KafkaSettings, KafkaSettingsError

log = logging.getLogger("stepstream.kafka.client")

# Starts made in a burst share requests; one made alone waits this long at most.
LINGER_MS = 2
_REQUIRED: dict[str, object] = {"acks": "all", "enable.idempotence": True}
_POLL_S = 0.1


class SendFailed(Exception):
    """Kafka did not take a command: why, in librdkafka's words."""


class CommandProducer:
    """``await CommandProducer.open(settings, ...)``; ``await send(...)`` returns the
    command's offset once every in-sync replica has it; ``await close()``."""

    def __init__(self, config: dict[str, object], loop: asyncio.AbstractEventLoop) -> None:
        try:
            self._producer = Producer(config)
        except (KafkaException, ValueError, TypeError) as exc:
            raise KafkaSettingsError(
                f"the kafka:// client's producer refused its configuration: {exc}; check "
                "the client's kafka properties"
            ) from None
        self._loop = loop
        self._reports: list[tuple[asyncio.Future[int], KafkaError | None, int]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._poll, name="stepstream-client-producer", daemon=True
        )
        self._thread.start()

    @classmethod
    def open(
        cls, settings: KafkaSettings, *, message_max_bytes: int, timeout_s: float
    ) -> CommandProducer:
        """The producer for ``settings``: the user's producer properties (librdkafka names)
        over stepstream's defaults; a command not acknowledged within ``timeout_s`` fails."""
        defaults: dict[str, object] = {
            "linger.ms": LINGER_MS,
            "message.max.bytes": message_max_bytes,
            "message.timeout.ms": int(timeout_s * 1000),
            "logger": logging.getLogger("stepstream.kafka.client.librdkafka"),
        }
        config = settings.client_config("producer", defaults, _REQUIRED)
        return cls(config, asyncio.get_running_loop())

    async def send(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes,
        partition: int,
        headers: list[tuple[str, str | bytes | None]] | None = None,
    ) -> int:
        """Publish one record; its offset once acknowledged, ``SendFailed`` if it was not."""
        fut: asyncio.Future[int] = self._loop.create_future()

        def delivered(err: KafkaError | None, msg: Message) -> None:  # the poll thread
            with self._lock:
                offset = msg.offset() if err is None else None
                self._reports.append((fut, err, -1 if offset is None else offset))

        while True:
            try:
                self._producer.produce(
                    topic, value, key, partition=partition, headers=headers, on_delivery=delivered
                )
                break
            except BufferError:
                # librdkafka's queue is full: wait for acknowledgements to drain it.
                await asyncio.sleep(0.005)
            except KafkaException as exc:
                raise SendFailed(str(exc.args[0] if exc.args else exc)) from None
        return await fut

    async def close(self, timeout: float = 10.0) -> None:
        """Flush what is queued (up to ``timeout`` seconds), then stop."""
        if self._stopping.is_set():
            return
        remaining = await asyncio.to_thread(self._producer.flush, timeout)
        if remaining:
            log.warning("closing the client with %d commands not acknowledged", remaining)
            self._producer.purge()
        self._stopping.set()
        await asyncio.to_thread(self._thread.join)
        # Destroys the handle and its connections now, not whenever it is collected.
        self._producer.close()

    def _poll(self) -> None:
        poll = self._producer.poll
        while not self._stopping.is_set():
            poll(_POLL_S)
            with self._lock:
                reports, self._reports = self._reports, []
            if reports:
                try:
                    self._loop.call_soon_threadsafe(_resolve, reports)
                except RuntimeError:
                    return  # the loop is closed: nobody waits for these any more


def _resolve(reports: list[tuple[asyncio.Future[int], KafkaError | None, int]]) -> None:
    for fut, err, offset in reports:
        if fut.done():
            continue  # the caller stopped waiting
        if err is not None:
            fut.set_exception(SendFailed(err.str()))
        else:
            fut.set_result(offset)
