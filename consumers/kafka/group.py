"""The worker's consumer group: one confluent-kafka consumer, run by a dedicated poll
thread, subscribed to the commands topic with the cooperative (incremental) protocol.

The group assigns commands partitions only; a worker that owns commands partition *p*
also fetches timers partition *p* (the topics are co-partitioned), added to and removed
from the consumer's assignment together with it. Subscribing to both would let the
sticky assignor split a partition number between two members.

Rebalances are incremental: a callback names only the partitions that change hands, and
the others keep being fetched and processed. A partition assigned is handed to the event
loop to be restored (``on_assign``) without waiting, and fetched once the loop says from
which offsets (``fetch``), so a long restore holds up no other partition. A partition
revoked is drained and given up before the callback returns (the group must not hand it
over while this worker still writes to it), which holds up fetching for the others for
as long as that drain lasts.

Records are handed to the event loop in batches (one ``call_soon_threadsafe`` per poll)
and land in one ``KafkaSource`` per topic kind and partition: the ``Source`` the partition
processor and timer service read.

Offsets are committed to the group asynchronously, after the state that covers them is
written (the local state keeps its own offsets; the group's are for a worker that comes
without local state).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from stepstream.consumers.kafka import keys
from stepstream.consumers.kafka.clients import make_client, through_elections
from stepstream.consumers.kafka.group_protocol import member_config
from stepstream.consumers.kafka.logins import LoginWatch, quiet_librdkafka
from stepstream.consumers.kafka.source import KafkaSource
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.seams import LogEntry
from stepstream.engine.wire.topics import COMMANDS, TIMERS, TopicNames

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
KINDS = (COMMANDS, TIMERS)
T = TypeVar("T")
# The group's offsets are committed when librdkafka's statistics (this often) show the
# group steady, never during a rebalance: see ``_on_stats``.
_STATS_INTERVAL_MS = 250

Position = tuple[str, int]  # (topic kind, partition)
AssignHandler = Callable[[list[int], dict[Position, int | None]], Coroutine[Any, Any, None]]
RevokeHandler = Callable[[list[int]], Coroutine[Any, Any, None]]


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
        watched: dict[str, object] = {"logger": quiet_librdkafka()} if logins else {}
        self._topics = TopicNames(settings.prefix)
        self._kind_of = {self._topics.name(kind): kind for kind in KINDS}
        self._config = member_config(
            settings,
            {**CONSUMER_DEFAULTS, "client.id": client_id},
            {
                **CONSUMER_REQUIRED,
                "group.id": keys.group_id(settings.prefix),
                "error_cb": self._on_error,
                "statistics.interval.ms": _STATS_INTERVAL_MS,
                "stats_cb": self._on_stats,
                **watched,
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
        # Partitions restored on the loop, waiting for the poll thread to fetch them from
        # these offsets (under the lock), and those it fetches (poll thread only).
        self._to_fetch: deque[tuple[int, dict[str, int]]] = deque()
        self._fetching: set[int] = set()
        self._failed = False
        self._mixed_protocols = False
        self._rebalanced = False  # a rebalance callback ran in the last poll
        self._steady = False  # the last statistics showed the group steady
        # (topic kind, partition) -> the log end offset the last statistics showed; read
        # for consumer lag.
        self._high_watermarks: dict[tuple[str, int], int] = {}

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

    def fetch(self, partition: int, starts: dict[str, int]) -> None:
        """The partition is restored: fetch its commands and timers from ``starts`` (topic
        kind -> offset). Sources must be attached first."""
        with self._lock:
            self._to_fetch.append((partition, dict(starts)))

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
                on_assign=self._assigned,
                on_revoke=self._revoked,
                on_lost=self._lost,
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
                if self._rebalanced:
                    self._rebalanced = False
                    self._wake_fetchers(consumer)
                if self._steady:
                    self._steady = False
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

    def _route(
        self, batch: list[Message], ends: dict[Position, int]
    ) -> dict[Position, list[LogEntry]]:
        """The records of ``batch`` by topic partition; the ends reached go to ``ends``."""
        routed: dict[Position, list[LogEntry]] = {}
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
            entry = LogEntry(
                topic or "", partition, msg.offset() or 0, msg.key() or b"", msg.value() or b""
            )
            routed.setdefault((kind, partition), []).append(entry)
        return routed

    def _wake_fetchers(self, consumer: Consumer) -> None:
        """librdkafka pauses every assigned partition while a rebalance callback is
        pending and resumes them when it is answered, but a fetcher that went idle in the
        meantime sleeps on for up to a second (measured: the first record 0.5-0.9 s after
        a 0.1 s pause, 2 ms with a seek; docs/kafka-notes.md). Seeking each partition to
        its own position wakes it: the partitions that stayed do not wait."""
        fetched = [
            TopicPartition(self._topics.name(k), p) for p in sorted(self._fetching) for k in KINDS
        ]
        if not fetched:
            return
        try:
            for tp in consumer.position(fetched):
                if tp.offset >= 0:  # else nothing was handed out yet: it starts anyway
                    consumer.seek(tp)
        except Exception as exc:
            log.warning("could not wake the fetchers after a rebalance: %s", exc)

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
        with self._lock:
            to_fetch, self._to_fetch = self._to_fetch, deque()
        started: list[Position] = []
        for partition, starts in to_fetch:
            consumer.incremental_assign(
                [TopicPartition(self._topics.name(k), partition, starts[k]) for k in KINDS]
            )
            self._fetching.add(partition)
            started.extend((k, partition) for k in KINDS)
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
        # Acknowledged with nothing to fetch yet: each partition is fetched once restored
        # (``fetch``), from the offsets its state covers.
        consumer.incremental_assign([])
        # Wake the fetchers once this poll returns. Not after a revoke: an assign (of
        # none, maybe) always follows it, with the partitions paused again until then,
        # and a seek while paused does not wake them.
        self._rebalanced = True
        partitions = sorted(tp.partition for tp in assigned if tp.topic in self._kind_of)
        if self._failed:
            return
        assert self._loop is not None
        if not partitions:
            # A member with nothing (more workers than partitions, or the assign that
            # follows a revoke) has joined all the same: it is ready, and says so.
            asyncio.run_coroutine_threadsafe(self._on_assign([], {}), self._loop).add_done_callback(
                self._taken
            )
            return
        log.info("group assigned partitions", extra={"partitions": partitions})
        try:
            wanted = [
                TopicPartition(self._topics.name(kind), p) for p in partitions for kind in KINDS
            ]
            committed: dict[Position, int | None] = {}
            offsets = through_elections(
                lambda: consumer.committed(wanted, timeout=30),
                f"reading the group's offsets of partitions {partitions}",
            )
            for tp in offsets:
                kind = self._kind_of[tp.topic]
                committed[(kind, tp.partition)] = tp.offset if tp.offset >= 0 else None
        except BaseException as exc:
            log.exception(
                "reading the group's offsets of partitions failed", extra={"partitions": partitions}
            )
            self._fail(exc)
            return
        taking = asyncio.run_coroutine_threadsafe(
            self._on_assign(partitions, committed), self._loop
        )
        taking.add_done_callback(self._taken)

    def _taken(self, taking: Future[None]) -> None:
        if not taking.cancelled() and (exc := taking.exception()) is not None:
            # With its traceback: an exception's text alone may say nothing.
            log.error("taking over partitions failed: %r", exc, exc_info=exc)
            self._fail(exc)

    def _revoked(self, consumer: Consumer, revoked: list[TopicPartition]) -> None:
        partitions = sorted({tp.partition for tp in revoked})
        log.info("group revoked partitions", extra={"partitions": partitions})
        began = time.monotonic()
        try:
            self._call(self._on_revoke(partitions))
        except BaseException as exc:
            log.exception("giving up partitions failed", extra={"partitions": partitions})
            self._fail(exc)
        self._commit(consumer, asynchronous=False, only=set(partitions))
        self._stop_fetching(consumer, partitions)
        # Fetching for every other partition stood still meanwhile.
        log.info(
            "gave up partitions in %.3f s",
            time.monotonic() - began,
            extra={"partitions": partitions},
        )

    def _lost(self, consumer: Consumer, lost: list[TopicPartition]) -> None:
        partitions = sorted({tp.partition for tp in lost})
        log.warning("group lost partitions (session timed out?)", extra={"partitions": partitions})
        with self._lock:
            for key in [k for k in self._to_commit if k[1] in partitions]:
                del self._to_commit[key]
        try:
            self._call(self._on_lost(partitions))
        except BaseException as exc:
            self._fail(exc)
        self._stop_fetching(consumer, partitions)

    def _stop_fetching(self, consumer: Consumer, partitions: list[int]) -> None:
        """Take the partitions' commands and timers out of the consumer's assignment (the
        call also acknowledges the revoke: an empty one when none was fetched yet)."""
        gone = set(partitions)
        with self._lock:
            self._to_fetch = deque(e for e in self._to_fetch if e[0] not in gone)
        fetched = sorted(gone & self._fetching)
        self._fetching -= gone
        try:
            consumer.incremental_unassign(
                [TopicPartition(self._topics.name(k), p) for p in fetched for k in KINDS]
            )
        except Exception as exc:
            log.error("partitions %s: cannot stop fetching: %s", fetched, exc)
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

    def _on_stats(self, stats: str) -> None:
        """Offsets are committed only right after the statistics show the group steady.
        A commit sent during a rebalance waits on the coordinator behind the SyncGroup;
        when that fails (another member rejoined), its ILLEGAL_GENERATION answer reaches a
        member back in ``init`` state, and librdkafka (2.16) declares the whole
        assignment lost (librdkafka issue 4059): every partition is given up without a
        drain and taken over again. Seen in 1 of ~8 joins with commits every 0.2 s."""
        try:
            parsed = json.loads(stats)
        except ValueError:
            return
        if self._logins is not None:
            self._logins.statistics("group", parsed)
        group = parsed.get("cgrp", {})
        self._steady = group.get("state") == "up" and group.get("join_state") == "steady"
        for name, topic in parsed.get("topics", {}).items():
            kind = self._kind_of.get(name)
            if kind is None:
                continue
            for partition, figures in topic.get("partitions", {}).items():
                high = figures.get("hi_offset", -1)
                if partition != "-1" and isinstance(high, int) and high >= 0:
                    self._high_watermarks[(kind, int(partition))] = high

    def high_watermark(self, kind: str, partition: int) -> int | None:
        """The end of the topic partition as the consumer last heard it (None: not yet)."""
        return self._high_watermarks.get((kind, partition))

    def _on_error(self, err: KafkaError) -> None:
        logins = self._logins
        if logins is not None and logins.refused("group", err):
            return  # reported there, once; fetching resumes once the login is accepted
        if logins is not None and logins.failing and err.code() == KafkaError._ALL_BROKERS_DOWN:
            return  # the refused login, again
        if err.fatal():
            log.error("Kafka consumer failed for good: %s", err.str())
            self._fail(RuntimeError(f"Kafka consumer failed: {err.str()}"))
        elif err.code() != KafkaError._TRANSPORT:
            log.warning("Kafka consumer error: %s", err.str())
