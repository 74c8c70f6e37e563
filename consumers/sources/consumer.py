"""The sources consumer: a member of the consumer group ``<prefix>.sources``, reading
the user topics that workflow modules declare ``Source`` objects for.

A batch of records becomes commands (keyed by instance id) and dead letters (with the
record's coordinates and the reason), handed together to a sink that returns once they
are durable: on a Kafka worker, the broker's acknowledgement on ``<prefix>.commands`` and
``<prefix>.dead-letters`` (``kafka_sink``); on ``stepstream dev``, the embedded log's
append. Offsets are committed only for records whose command or dead letter is durable;
a consumer that dies before its commit leaves them to be read again, and a re-read
record becomes the same command (id ``topic/partition/offset``), which its instance
applies once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from stepstream.consumers.kafka import keys
from stepstream.consumers.kafka.clients import make_client
from stepstream.consumers.kafka.group import CONSUMER_DEFAULTS as GROUP_CONSUMER_DEFAULTS
from stepstream.consumers.kafka.group_protocol import member_config
from stepstream.consumers.kafka.librdkafka_log import quiet_librdkafka
from stepstream.consumers.kafka.producer import LogProducer, OutRecord
from stepstream.consumers.sources.lag import SourceLag
from stepstream.consumers.sources.translate import (
    RecordTranslator,
    SourceRecord,
    Unreadable,
    dead_letter,
)
from stepstream.engine.api.sources import Source
from stepstream.engine.config.environ import env_int, env_seconds
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.seams import Append, Clock
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.topics import COMMANDS, DEAD_LETTERS, TopicNames, partition_for

log = logging.getLogger("stepstream.sources")

# The same defaults as the workers' own group.
CONSUMER_DEFAULTS = GROUP_CONSUMER_DEFAULTS
CONSUMER_REQUIRED: dict[str, object] = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "enable.partition.eof": False,
    "auto.offset.reset": "earliest",
    "allow.auto.create.topics": False,
}
_POLL_S = 0.5
_RETRY_S = 1.0

Position = tuple[str, int]
# Makes records durable (raises if it cannot); ``Append.kind`` is a topic kind.
Sink = Callable[[Sequence[Append]], Awaitable[object]]


def kafka_sink(producer: LogProducer, prefix: str, partitions: int) -> Sink:
    """Produce to the prefix's topics, each record on its key's partition; returns once
    the broker acknowledged every one."""
    topics = TopicNames(prefix)

    async def send(appends: Sequence[Append]) -> list[int]:
        return await producer.send(
            [
                OutRecord(
                    topics.name(a.kind),
                    partition_for(a.key.decode(), partitions),
                    a.key,
                    a.value,
                )
                for a in appends
            ]
        )

    return send


@dataclass(frozen=True)
class SourcesConfig:
    # Offsets are committed at most this often (and on revoke and stop): a commit is a
    # broker round trip, and a record read again after a crash is applied once anyway.
    commit_interval_s: float = 1.0
    # Records taken from the consumer per batch (one produce of their commands).
    batch_size: int = 500
    # How often the lag is logged while it changes.
    lag_log_interval_s: float = 30.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SourcesConfig:
        env = os.environ if env is None else env
        return cls(
            commit_interval_s=env_seconds(env, "STEPSTREAM_SOURCES_COMMIT_INTERVAL_S", 1.0),
            batch_size=env_int(env, "STEPSTREAM_SOURCES_BATCH", 500),
            lag_log_interval_s=env_seconds(env, "STEPSTREAM_SOURCES_LAG_LOG_S", 30.0),
        )


class SourceConsumer:
    """``await start()``, ``await stop()``; ``lag`` is readable at any time."""

    def __init__(
        self,
        settings: KafkaSettings,
        sources: Sequence[Source],
        *,
        sink: Sink,
        serde: RecordSerde,
        codec: PayloadCodec,
        clock: Clock,
        max_payload_bytes: int,
        config: SourcesConfig | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._settings = settings
        self._translators = {
            s.topic: RecordTranslator(s, codec, max_payload_bytes) for s in sources
        }
        self._max_payload_bytes = max_payload_bytes
        self._sink = sink
        self._serde = serde
        self._clock = clock
        self._config = config or SourcesConfig()
        self._on_fatal = on_fatal
        self.lag = SourceLag()
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Next offset to commit, per partition: all before it are durable commands.
        self._durable: dict[Position, int] = {}
        self._committed: dict[Position, int] = {}
        self._assigned: set[Position] = set()
        self._start: dict[Position, int] = {}
        self._last_commit = 0.0
        self._last_lag_log = 0.0
        self._missing_reported: set[str] = set()

    @property
    def topics(self) -> list[str]:
        return sorted(self._translators)

    async def start(self) -> None:
        config = member_config(
            self._settings,
            {**CONSUMER_DEFAULTS, "client.id": "stepstream-sources"},
            {
                **CONSUMER_REQUIRED,
                "group.id": keys.sources_group_id(self._settings.prefix),
                "logger": quiet_librdkafka(),  # its lines in the process's log format
            },
        )
        self._consumer = make_client(Consumer, config, "sources consumer")
        self._consumer.subscribe(
            self.topics,
            on_assign=self._assigned_cb,
            on_revoke=self._revoked_cb,
            on_lost=self._lost_cb,
        )
        self._last_commit = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._run(), name="stepstream-sources")
        log.info(
            "consuming sources topics=%s group=%s",
            self.topics,
            keys.sources_group_id(self._settings.prefix),
        )

    async def stop(self) -> None:
        """Finish the batch in hand, commit what is durable, leave the group."""
        self._stopping = True
        if self._task is not None:
            try:
                await self._task
            except Exception:
                pass  # reported by _run already
            self._task = None
        if self._consumer is not None:
            await asyncio.to_thread(self._close)

    # ---- the loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                messages = await asyncio.to_thread(
                    self._consumer.consume, self._config.batch_size, _POLL_S
                )
                records = [r for r in map(self._record, messages) if r is not None]
                if records:
                    await self._make_durable(records)
                    for record in records:
                        self._durable[(record.topic, record.partition)] = record.offset + 1
                if self._durable != self._committed and (
                    loop.time() - self._last_commit >= self._config.commit_interval_s
                ):
                    self._last_commit = loop.time()
                    await asyncio.to_thread(self._commit, None)
                self._measure_lag(loop.time())
        except Exception as exc:
            log.exception("the sources consumer failed")
            if self._on_fatal is not None:
                self._on_fatal(exc)
            raise

    def _record(self, message: Message) -> SourceRecord | None:
        error = message.error()
        if error is not None:
            topic = message.topic() or "?"
            if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                if topic not in self._missing_reported:
                    self._missing_reported.add(topic)
                    log.warning(
                        "source topic %s does not exist; create it (records are read "
                        "once it exists, from its first offset)",
                        topic,
                    )
            else:
                log.warning("sources consumer: %s", error.str())
            return None
        headers = [
            (str(name), value.encode() if isinstance(value, str) else value)
            for name, value in cast(list[tuple[str, Any]], message.headers() or [])
        ]
        return SourceRecord(
            message.topic() or "",
            message.partition() or 0,
            message.offset() or 0,
            message.key(),
            message.value(),
            headers,
        )

    async def _make_durable(self, records: list[SourceRecord]) -> None:
        now = self._clock.now_ms()
        out: list[Append] = []
        for record in records:
            translator = self._translators[record.topic]
            try:
                command = translator.command(record, now)
                value = self._serde.encode(command)
            except Unreadable as problem:
                out.append(self._dead_letter(record, problem, now))
                continue
            except Exception as exc:  # a value the record schemas refuse
                out.append(self._dead_letter(record, Unreadable(str(exc)), now))
                continue
            out.append(Append(COMMANDS, command.instance_id.encode(), value))
        await self._sink(out)

    def _dead_letter(self, record: SourceRecord, problem: Unreadable, now: int) -> Append:
        log.warning("source record %s sent to dead-letters: %s", record.command_id, problem.reason)
        letter = dead_letter(record, problem, now, self._max_payload_bytes)
        key = problem.instance_id or record.command_id
        return Append(DEAD_LETTERS, key.encode(), self._serde.encode(letter))

    # ---- offsets and lag (commit and close run on a thread: they block) -------------------

    def _commit(self, only: list[Position] | None) -> None:
        offsets = [
            TopicPartition(topic, partition, offset)
            for (topic, partition), offset in self._durable.items()
            if (only is None or (topic, partition) in only)
            and self._committed.get((topic, partition)) != offset
        ]
        if not offsets or self._consumer is None:
            return
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            # Not fatal: uncommitted records are read again and applied once.
            log.warning("could not commit source offsets: %s", exc)
            return
        for tp in offsets:
            self._committed[(tp.topic, tp.partition)] = tp.offset

    def _close(self) -> None:
        try:
            self._commit(None)
        finally:
            consumer, self._consumer = self._consumer, None
            consumer.close()

    def _measure_lag(self, now: float) -> None:
        if self._consumer is None:
            return
        for topic, partition in list(self._assigned):
            tp = TopicPartition(topic, partition)
            _low, high = self._consumer.get_watermark_offsets(tp, cached=True)
            position = self._durable.get((topic, partition), self._start.get((topic, partition)))
            if high is not None and high >= 0 and position is not None and position >= 0:
                self.lag.set(topic, partition, high - position)
        if now - self._last_lag_log >= self._config.lag_log_interval_s and self.lag.total():
            self._last_lag_log = now
            log.info("source lag %s", self.lag.describe())

    # ---- rebalance callbacks (on the consume thread) --------------------------------------

    def _assigned_cb(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self._assigned.update((tp.topic, tp.partition) for tp in partitions)
        # Where reading starts, so an empty or idle partition's lag is known too: the
        # group's committed offset, else (auto.offset.reset=earliest) the first offset.
        try:
            committed = consumer.committed(partitions, timeout=10)
        except KafkaException as exc:
            log.warning("could not read committed source offsets: %s", exc)
            committed = []
        for tp in committed:
            start = tp.offset
            if start < 0:
                try:
                    start, _high = consumer.get_watermark_offsets(tp, timeout=10)
                except KafkaException:
                    continue
            self._start[(tp.topic, tp.partition)] = start
        log.info("sources assigned %s", [f"{tp.topic}[{tp.partition}]" for tp in partitions])

    def _revoked_cb(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        revoked = [(tp.topic, tp.partition) for tp in partitions]
        self._commit(revoked)  # the next owner starts after what is durable here
        self._forget(revoked)

    def _lost_cb(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self._forget([(tp.topic, tp.partition) for tp in partitions])

    def _forget(self, positions: list[Position]) -> None:
        for position in positions:
            self._assigned.discard(position)
            self._durable.pop(position, None)
            self._committed.pop(position, None)
            self._start.pop(position, None)
            self.lag.drop(*position)
