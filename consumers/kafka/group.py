"""The worker's consumer group: one confluent-kafka consumer, subscribed to the commands
and timers topics, run by a dedicated poll thread.

The topics are co-partitioned and the range assignor gives a member the same partition
numbers of both, so a worker owns partition *p* of commands and of timers together.
Records are handed to the event loop in batches (one ``call_soon_threadsafe`` per poll)
and land in one ``KafkaSource`` per topic kind and partition: the ``Source`` the partition
processor and timer service read. Rebalance callbacks run on the poll thread; they hand
the work (restore, assign, revoke) to the event loop and wait for it, so a partition's
fetching starts only at the offsets its restored state covers.

Offsets are committed to the group asynchronously, after the state that covers them is
written (the local state keeps its own offsets; the group's are for a worker that comes
without local state).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from consumers.kafka import keys
from consumers.kafka.clients import make_client
from engine.kafka_settings import KafkaSettings
from engine.seams import LogEntry
from engine.topics import COMMANDS, TIMERS, TopicNames

log = logging.getLogger("stepstream.kafka.group")

CONSUMER_DEFAULTS: dict[str, object] = {
    "session.timeout.ms": 6000,
    "heartbeat.interval.ms": 1000,
    # Tansu answers a parked fetch only when it expires, so this bounds latency.
    "fetch.wait.max.ms": 5,
    "fetch.min.bytes": 1,
}
CONSUMER_REQUIRED: dict[str, object] = {
    "partition.assignment.strategy": "range",
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "enable.partition.eof": False,
    "auto.offset.reset": "earliest",
    "allow.auto.create.topics": False,
}
KINDS = (COMMANDS, TIMERS)
T = TypeVar("T")
_COMMIT_INTERVAL_S = 0.2
_PAUSE_ABOVE = 50_000  # buffered records of one source before its fetching pauses
_RESUME_BELOW = 5_000

Position = tuple[str, int]  # (topic kind, partition)
AssignHandler = Callable[
    [list[int], dict[Position, int | None]], Coroutine[Any, Any, dict[Position, int]]
]
RevokeHandler = Callable[[list[int]], Coroutine[Any, Any, None]]


class KafkaSource:
    """Records of one topic partition, in offset order, from ``position`` on. Filled by
    the poll thread (through the loop), read by the partition's processor or timers."""

    def __init__(self, kind: str, partition: int, position: int) -> None:
        self.kind = kind
        self.partition = partition
        self.position = position
        self._next = position
        self._buffer: deque[LogEntry] = deque()
        self._arrived = asyncio.Event()
        # Told when the buffer grows too long (True) or drains again (False).
        self.on_level: Callable[[KafkaSource, bool], None] | None = None
        # Told to re-read the topic partition from an offset (a commit failed).
        self.on_rewind: Callable[[KafkaSource, int], None] | None = None
        self.paused = False

    def rewind(self, offset: int) -> None:
        """Deliver again from ``offset``: drop what is buffered and seek the consumer."""
        self._buffer.clear()
        self.position = self._next = offset
        if self.on_rewind is not None:
            self.on_rewind(self, offset)

    def push(self, entries: list[LogEntry]) -> None:
        """Loop side: append records (any before the next expected offset are old)."""
        fresh = [e for e in entries if e.offset >= self._next]
        if not fresh:
            return
        self._buffer.extend(fresh)
        self._next = fresh[-1].offset + 1
        self._arrived.set()
        if not self.paused and len(self._buffer) > _PAUSE_ABOVE and self.on_level:
            self.on_level(self, True)

    async def fetch(self, max_records: int, timeout: float) -> list[LogEntry]:
        """The next records (at most ``max_records``), waiting up to ``timeout`` seconds
        for the first; an empty list when none came."""
        if not self._buffer:
            self._arrived.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._arrived.wait()
            except TimeoutError:
                return []
        buffer = self._buffer
        count = min(max_records, len(buffer))
        entries = [buffer.popleft() for _ in range(count)]
        if entries:
            self.position = entries[-1].offset + 1
        if self.paused and len(buffer) < _RESUME_BELOW and self.on_level:
            self.on_level(self, False)
        return entries


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
    ) -> None:
        self._topics = TopicNames(settings.prefix)
        self._kind_of = {self._topics.name(kind): kind for kind in KINDS}
        self._config = settings.client_config(
            "consumer",
            {**CONSUMER_DEFAULTS, "client.id": client_id},
            {
                **CONSUMER_REQUIRED,
                "group.id": keys.group_id(settings.prefix),
                "error_cb": self._on_error,
            },
        )
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        # Partitions lost (session expired): another member may own them already, so
        # they are given up at once rather than drained.
        self._on_lost = on_lost or on_revoke
        self._on_fatal = on_fatal
        self._sources: dict[Position, KafkaSource] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._to_commit: dict[Position, int] = {}
        self._flow: deque[tuple[Position, bool]] = deque()
        self._seeks: deque[tuple[Position, int]] = deque()
        self._failed = False

    # ---- loop side --------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
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

    def detach(self, partition: int) -> None:
        for kind in KINDS:
            self._sources.pop((kind, partition), None)

    def consumed(self, kind: str, partition: int, offset: int) -> None:
        """State covering ``kind`` up to ``offset`` is written: commit it to the group
        (soon, asynchronously)."""
        with self._lock:
            self._to_commit[(kind, partition)] = offset

    def _flow_control(self, source: KafkaSource, pause: bool) -> None:
        source.paused = pause
        self._flow.append(((source.kind, source.partition), pause))

    def _rewind(self, source: KafkaSource, offset: int) -> None:
        self._seeks.append(((source.kind, source.partition), offset))

    def _deliver(self, batches: dict[Position, list[LogEntry]]) -> None:
        for position, entries in batches.items():
            source = self._sources.get(position)
            if source is not None:
                source.push(entries)

    # ---- poll thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            consumer = make_client(Consumer, self._config, "group consumer")
        except BaseException as exc:
            self._fail(exc)
            return
        try:
            consumer.subscribe(
                list(self._kind_of),
                on_assign=self._assigned,
                on_revoke=self._revoked,
                on_lost=self._lost,
            )
            last_commit = 0.0
            loop = self._loop
            assert loop is not None
            while not self._stopping.is_set():
                self._apply_flow(consumer)
                msg = consumer.poll(0.05)
                if msg is not None:
                    batch = [msg, *consumer.consume(999, 0)]
                    routed = self._route(batch)
                    if routed:
                        loop.call_soon_threadsafe(self._deliver, routed)
                now = loop.time()
                if now - last_commit >= _COMMIT_INTERVAL_S:
                    last_commit = now
                    self._commit(consumer, asynchronous=True)
            self._commit(consumer, asynchronous=False)
        except BaseException as exc:
            log.exception("the group consumer's poll thread failed")
            self._fail(exc)
        finally:
            try:
                consumer.close()
            except Exception:
                log.exception("closing the group consumer failed")

    def _route(self, batch: list[Message]) -> dict[Position, list[LogEntry]]:
        routed: dict[Position, list[LogEntry]] = {}
        for msg in batch:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("group consumer: %s", err.str())
                continue
            topic = msg.topic()
            kind = self._kind_of.get(topic or "")
            partition = msg.partition()
            if kind is None or partition is None:
                continue
            entry = LogEntry(
                topic or "", partition, msg.offset() or 0, msg.key() or b"", msg.value() or b""
            )
            routed.setdefault((kind, partition), []).append(entry)
        return routed

    def _apply_flow(self, consumer: Consumer) -> None:
        while self._seeks:
            (kind, partition), offset = self._seeks.popleft()
            try:
                consumer.seek(TopicPartition(self._topics.name(kind), partition, offset))
            except Exception as exc:
                log.error("partition=%d %s: cannot seek to %d: %s", partition, kind, offset, exc)
        while self._flow:
            (kind, partition), pause = self._flow.popleft()
            tp = [TopicPartition(self._topics.name(kind), partition)]
            try:
                consumer.pause(tp) if pause else consumer.resume(tp)
            except Exception as exc:
                log.warning("partition=%d %s: cannot %s: %s", partition, kind, pause, exc)

    def _commit(
        self, consumer: Consumer, *, asynchronous: bool, only: set[int] | None = None
    ) -> None:
        with self._lock:
            if only is None:
                taken, self._to_commit = self._to_commit, {}
            else:
                taken = {k: v for k, v in self._to_commit.items() if k[1] in only}
                for k in taken:
                    del self._to_commit[k]
        if not taken:
            return
        offsets = [
            TopicPartition(self._topics.name(kind), partition, offset)
            for (kind, partition), offset in taken.items()
        ]
        try:
            if asynchronous:
                consumer.commit(offsets=offsets, asynchronous=True)
            else:
                consumer.commit(offsets=offsets, asynchronous=False)
        except Exception as exc:
            # Only the group's copy lags; the local state has its own offsets.
            log.warning("committing offsets to the group failed: %s", exc)

    def _assigned(self, consumer: Consumer, assigned: list[TopicPartition]) -> None:
        if self._failed:
            return
        by_partition: dict[int, set[str]] = {}
        for tp in assigned:
            kind = self._kind_of.get(tp.topic)
            if kind is not None:
                by_partition.setdefault(tp.partition, set()).add(kind)
        partitions = sorted(p for p, kinds in by_partition.items() if kinds == set(KINDS))
        lopsided = sorted(set(by_partition) - set(partitions))
        if lopsided:
            log.error(
                "partitions %s were assigned for one of commands/timers only: are all "
                "workers subscribed to both with partition.assignment.strategy=range, and "
                "do both topics have the same partition count? Not processing them",
                lopsided,
            )
        log.info("group assigned partitions=%s", partitions)
        try:
            wanted = [
                TopicPartition(self._topics.name(kind), p) for p in partitions for kind in KINDS
            ]
            committed: dict[Position, int | None] = {}
            if wanted:
                for tp in consumer.committed(wanted, timeout=30):
                    kind = self._kind_of[tp.topic]
                    committed[(kind, tp.partition)] = tp.offset if tp.offset >= 0 else None
            starts = self._call(self._on_assign(partitions, committed))
            consumer.assign(
                [
                    TopicPartition(self._topics.name(kind), p, starts[(kind, p)])
                    for p in partitions
                    for kind in KINDS
                ]
            )
        except BaseException as exc:
            log.exception("taking over partitions %s failed", partitions)
            self._fail(exc)
            consumer.assign([])

    def _revoked(self, consumer: Consumer, revoked: list[TopicPartition]) -> None:
        partitions = sorted({tp.partition for tp in revoked})
        log.info("group revoked partitions=%s", partitions)
        try:
            self._call(self._on_revoke(partitions))
        except BaseException as exc:
            log.exception("giving up partitions %s failed", partitions)
            self._fail(exc)
        self._commit(consumer, asynchronous=False, only=set(partitions))

    def _lost(self, consumer: Consumer, lost: list[TopicPartition]) -> None:
        partitions = sorted({tp.partition for tp in lost})
        log.warning("group lost partitions=%s (session timed out?)", partitions)
        with self._lock:
            for key in [k for k in self._to_commit if k[1] in partitions]:
                del self._to_commit[key]
        try:
            self._call(self._on_lost(partitions))
        except BaseException as exc:
            self._fail(exc)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the event loop and wait for it (the poll thread blocks)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _fail(self, exc: BaseException) -> None:
        if self._failed:
            return
        self._failed = True
        self._stopping.set()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_fatal, exc)

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            log.error("Kafka consumer failed for good: %s", err.str())
            self._fail(RuntimeError(f"Kafka consumer failed: {err.str()}"))
        elif err.code() != KafkaError._TRANSPORT:
            log.warning("Kafka consumer error: %s", err.str())
