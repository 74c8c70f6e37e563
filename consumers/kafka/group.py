"""The worker's consumer group: one confluent-kafka consumer, run by a dedicated poll
thread, subscribed to the commands topic with the cooperative (incremental) protocol.

What the group assigns, and how this worker takes and gives up partitions, is
``group_assignment``; the offsets it commits to the group, ``group_offsets``; what its
statistics say (a steady group, the partitions' ends), ``group_stats``. This module runs
the poll loop and carries records and flow control between it and the event loop.

Records are handed to the event loop in batches (one ``call_soon_threadsafe`` per poll)
and land in one ``KafkaSource`` per topic kind and partition: the ``Source`` the partition
processor and timer service read.

Offsets are committed to the group asynchronously, after the state that covers them is
written (the local state keeps its own offsets; the group's are for a worker that comes
without local state).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from confluent_kafka import (
    TIMESTAMP_LOG_APPEND_TIME,
    Consumer,
    KafkaError,
    Message,
    TopicPartition,
)

from stepstream.consumers.kafka import keys
from stepstream.consumers.kafka.clients import make_client
from stepstream.consumers.kafka.group_assignment import (
    KINDS,
    AssignHandler,
    GroupAssignment,
    RevokeHandler,
)
from stepstream.consumers.kafka.group_offsets import GroupOffsets, Position
from stepstream.consumers.kafka.group_protocol import member_config
from stepstream.consumers.kafka.group_stats import STATS_INTERVAL_MS, GroupStatistics
from stepstream.consumers.kafka.librdkafka_log import SameLineLimit, quiet_librdkafka
from stepstream.consumers.kafka.logins import LoginWatch
from stepstream.consumers.kafka.source import KafkaSource
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.seams import LogEntry
from stepstream.engine.wire.topics import COMMANDS, TopicNames

log = logging.getLogger("stepstream.kafka.group")

CONSUMER_DEFAULTS: dict[str, object] = {
    "session.timeout.ms": 6000,
    "heartbeat.interval.ms": 1000,
    # How long the broker may hold a fetch that finds nothing new. A Kafka broker answers
    # as soon as data arrives; the test broker (Tansu) only when the wait expires, so
    # there this bounds the latency of a command reaching an idle worker (about half of
    # it on average), and each expired wait is a request the broker serves: at 5 ms an
    # idle worker cost it 16% of a core and W1 on two workers ran 2-6% slower than at
    # 25 ms, which adds about 2 ms to one 10-step workflow (docs/performance.md).
    "fetch.wait.max.ms": 25,
    "fetch.min.bytes": 1,
}
CONSUMER_REQUIRED: dict[str, object] = {
    # Incremental rebalancing. With the classic protocol (the default: the development
    # broker does not serve KIP-848's) it takes the cooperative assignor, and members of
    # an eager one cannot share the group; with group.protocol=consumer every rebalance
    # is incremental and the broker assigns (consumers/kafka/group_protocol.py).
    "partition.assignment.strategy": "cooperative-sticky",
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    # The end of each partition as the consumer reaches it: a processor that has applied
    # everything up to it takes its timers' fires without the commands topic.
    "enable.partition.eof": True,
    "auto.offset.reset": "earliest",
    "allow.auto.create.topics": False,
}


class GroupConsumer:
    """Start with ``start()`` on the event loop; ``await stop()`` leaves the group (the
    revoke handler runs for what is still owned)."""

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        on_assign: AssignHandler,
        on_revoke: RevokeHandler,
        on_lost: RevokeHandler | None = None,
        on_fatal: Callable[[BaseException], None],
        client_id: str = "stepstream-worker",
        logins: LoginWatch | None = None,
    ) -> None:
        """``logins`` hears of a login the cluster refuses while the worker runs."""
        self._logins = logins
        self._repeats = SameLineLimit()  # an outage queues the same error many times
        watched: dict[str, object] = {"logger": quiet_librdkafka()} if logins else {}
        self._topics = TopicNames(settings.prefix)
        self._kind_of = {self._topics.name(kind): kind for kind in KINDS}
        self._offsets = GroupOffsets(self._topics)
        # The group's offsets are committed when the statistics show the group steady,
        # never during a rebalance (``group_stats``).
        self._stats = GroupStatistics(self._kind_of, logins)
        self._config = member_config(
            settings,
            {**CONSUMER_DEFAULTS, "client.id": client_id},
            {
                **CONSUMER_REQUIRED,
                "group.id": keys.group_id(settings.prefix),
                "error_cb": self._on_error,
                "statistics.interval.ms": STATS_INTERVAL_MS,
                "stats_cb": self._stats.heard,
                **watched,
            },
        )
        self._assignment = GroupAssignment(
            self._topics,
            self._offsets,
            on_assign=on_assign,
            on_revoke=on_revoke,
            on_lost=on_lost or on_revoke,
            fail=self._fail,
            failed=lambda: self._failed,
        )
        self._on_fatal = on_fatal
        self._sources: dict[Position, KafkaSource] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._flow: deque[tuple[Position, bool]] = deque()
        self._seeks: deque[tuple[Position, int]] = deque()
        self._failed = False
        self._mixed_protocols = False

    # ---- loop side --------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._assignment.start(self._loop)
        self._thread = threading.Thread(
            target=self._run, name="stepstream-kafka-group", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def attach(self, source: KafkaSource) -> None:
        """Records of ``source``'s topic partition go to it from now on."""
        source.on_level = self._flow_control
        source.on_rewind = self._rewind
        self._sources[(source.kind, source.partition)] = source

    def fetch(self, partition: int, starts: dict[str, int]) -> None:
        """The partition is restored: fetch its commands and timers from ``starts`` (topic
        kind -> offset). Sources must be attached first."""
        self._assignment.fetch(partition, starts)

    def detach(self, partition: int) -> None:
        for kind in KINDS:
            self._sources.pop((kind, partition), None)

    def consumed(self, kind: str, partition: int, offset: int) -> None:
        """State covering ``kind`` up to ``offset`` is written: commit it to the group
        (soon, asynchronously)."""
        self._offsets.consumed(kind, partition, offset)

    def high_watermark(self, kind: str, partition: int) -> int | None:
        """The end of the topic partition as the consumer last heard it (None: not yet)."""
        return self._stats.high_watermark(kind, partition)

    @property
    def unreachable_since(self) -> float | None:
        """Since when (epoch seconds) no broker is up, as the consumer last heard; None
        while one is."""
        return self._stats.unreachable_since

    def _flow_control(self, source: KafkaSource, pause: bool) -> None:
        source.paused = pause
        self._flow.append(((source.kind, source.partition), pause))

    def _rewind(self, source: KafkaSource, offset: int) -> None:
        self._seeks.append(((source.kind, source.partition), offset))

    def _deliver(self, batches: dict[Position, list[LogEntry]], ends: dict[Position, int]) -> None:
        for position, entries in batches.items():
            source = self._sources.get(position)
            if source is not None:
                source.push(entries)
        for position, offset in ends.items():
            source = self._sources.get(position)
            if source is not None:
                source.reached_end(offset)

    def _started(self, positions: list[Position]) -> None:
        """The consumer now fetches these from their sources' positions (an assignment
        or a seek was applied): ends it reaches from now on are the sources' to hear."""
        for position in positions:
            source = self._sources.get(position)
            if source is not None:
                source.started()

    # ---- poll thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            consumer = make_client(Consumer, self._config, "group consumer")
        except BaseException as exc:
            self._fail(exc)
            return
        try:
            consumer.subscribe(
                [self._topics.name(COMMANDS)],
                on_assign=self._assignment.assigned,
                on_revoke=self._assignment.revoked,
                on_lost=self._assignment.lost,
            )
            loop = self._loop
            assert loop is not None
            while not self._stopping.is_set():
                self._apply_flow(consumer)
                msg = consumer.poll(0.05)
                if msg is not None:
                    batch = [msg, *consumer.consume(999, 0)]
                    ends: dict[Position, int] = {}
                    routed = self._route(batch, ends)
                    if routed or ends:
                        loop.call_soon_threadsafe(self._deliver, routed, ends)
                self._assignment.polled(consumer)
                if self._stats.take_steady():
                    self._offsets.commit(consumer, asynchronous=True)
            self._offsets.commit(consumer, asynchronous=False)
        except BaseException as exc:
            log.exception("the group consumer's poll thread failed")
            self._fail(exc)
        finally:
            try:
                consumer.close()
            except Exception:
                log.exception("closing the group consumer failed")

    def _route(
        self, batch: list[Message], ends: dict[Position, int]
    ) -> dict[Position, list[LogEntry]]:
        """The records of ``batch`` by topic partition; the ends reached go to ``ends``.
        Each record's ``accepted_ms`` is the broker's append time when the topic keeps
        one (``message.timestamp.type=LogAppendTime``, as ``topics create`` makes the
        commands topic), else now: a client's own stamp is never trusted for it."""
        routed: dict[Position, list[LogEntry]] = {}
        received_ms = time.time_ns() // 1_000_000
        for msg in batch:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    kind = self._kind_of.get(msg.topic() or "")
                    partition, offset = msg.partition(), msg.offset()
                    if kind is not None and partition is not None and offset is not None:
                        ends[(kind, partition)] = offset
                elif err.code() == KafkaError.INCONSISTENT_GROUP_PROTOCOL:
                    self._refused_join(err)
                else:
                    log.warning("group consumer: %s", err.str())
                continue
            topic = msg.topic()
            kind = self._kind_of.get(topic or "")
            partition = msg.partition()
            if kind is None or partition is None:
                continue
            stamp, at = msg.timestamp()
            entry = LogEntry(
                topic or "",
                partition,
                msg.offset() or 0,
                msg.key() or b"",
                msg.value() or b"",
                at if stamp == TIMESTAMP_LOG_APPEND_TIME else received_ms,
            )
            routed.setdefault((kind, partition), []).append(entry)
        return routed

    def _refused_join(self, err: KafkaError) -> None:
        # Workers of a stepstream that used the eager assignor: the group takes one
        # protocol, so this worker waits outside it (and keeps retrying) until they leave.
        if not self._mixed_protocols:
            self._mixed_protocols = True
            log.error(
                "the group %s refused this worker (%s): workers of an older stepstream "
                "version (eager rebalancing) are in it. Stop all of them, then start "
                "this version; the two cannot share a group, so upgrade with a full stop "
                "rather than a rolling restart. Retrying until they are gone",
                self._config["group.id"],
                err.str(),
            )

    def _apply_flow(self, consumer: Consumer) -> None:
        started = self._assignment.begin_fetching(consumer)
        while self._seeks:
            (kind, partition), offset = self._seeks.popleft()
            try:
                consumer.seek(TopicPartition(self._topics.name(kind), partition, offset))
            except Exception as exc:
                log.error(
                    "%s: cannot seek to %d: %s", kind, offset, exc, extra={"partition": partition}
                )
                continue
            started.append((kind, partition))
        if started and self._loop is not None:
            # Behind whatever this thread routed before: an end reached earlier is heard
            # first, and ignored by a source that has not started.
            self._loop.call_soon_threadsafe(self._started, started)
        while self._flow:
            (kind, partition), pause = self._flow.popleft()
            tp = [TopicPartition(self._topics.name(kind), partition)]
            try:
                consumer.pause(tp) if pause else consumer.resume(tp)
            except Exception as exc:
                log.warning(
                    "%s: cannot %s: %s",
                    kind,
                    "pause" if pause else "resume",
                    exc,
                    extra={"partition": partition},
                )

    def _fail(self, exc: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        self._stopping.set()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_fatal, exc)

    def _on_error(self, err: KafkaError) -> None:
        logins = self._logins
        if logins is not None and logins.refused("group", err):
            return  # reported there, once; fetching resumes once the login is accepted
        if logins is not None and logins.failing and err.code() == KafkaError._ALL_BROKERS_DOWN:
            return  # the refused login, again
        if err.fatal():
            log.error("Kafka consumer failed for good: %s", err.str())
            self._fail(RuntimeError(f"Kafka consumer failed: {err.str()}"))
        elif err.code() != KafkaError._TRANSPORT and self._repeats.fresh(err.str()):
            log.warning("Kafka consumer error: %s", err.str())
