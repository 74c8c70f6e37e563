"""Which partitions a worker's group consumer fetches, and what it does when the group
assigns, revokes or loses them (the rebalance callbacks, run on the poll thread).

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
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from confluent_kafka import Consumer, TopicPartition

from stepstream.consumers.kafka.clients import through_elections
from stepstream.consumers.kafka.group_offsets import GroupOffsets, Position
from stepstream.engine.wire.topics import COMMANDS, TIMERS, TopicNames

log = logging.getLogger("stepstream.kafka.group")

KINDS = (COMMANDS, TIMERS)
T = TypeVar("T")

AssignHandler = Callable[[list[int], dict[Position, int | None]], Coroutine[Any, Any, None]]
RevokeHandler = Callable[[list[int]], Coroutine[Any, Any, None]]


class GroupAssignment:
    """The partitions fetched, and the handlers of a rebalance. ``fetch`` is called from
    the event loop, the rest from the poll thread."""

    def __init__(
        self,
        topics: TopicNames,
        offsets: GroupOffsets,
        *,
        on_assign: AssignHandler,
        on_revoke: RevokeHandler,
        on_lost: RevokeHandler,
        fail: Callable[[BaseException], None],
        failed: Callable[[], bool],
    ) -> None:
        """``fail`` stops the consumer for good; ``failed`` says whether it was."""
        self._topics = topics
        self._kind_of = {topics.name(kind): kind for kind in KINDS}
        self._offsets = offsets
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        # Partitions lost (session expired): another member may own them already, so
        # they are given up at once rather than drained.
        self._on_lost = on_lost
        self._fail = fail
        self._failed = failed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        # Partitions restored on the loop, waiting for the poll thread to fetch them from
        # these offsets (under the lock), and those it fetches (poll thread only).
        self._to_fetch: deque[tuple[int, dict[str, int]]] = deque()
        self._fetching: set[int] = set()
        self._rebalanced = False  # a rebalance callback ran in the last poll

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The handlers run on ``loop``."""
        self._loop = loop

    def fetch(self, partition: int, starts: dict[str, int]) -> None:
        """The partition is restored: fetch its commands and timers from ``starts`` (topic
        kind -> offset)."""
        with self._lock:
            self._to_fetch.append((partition, dict(starts)))

    # ---- poll thread --------------------------------------------------------------------

    def begin_fetching(self, consumer: Consumer) -> list[Position]:
        """Add the partitions restored since the last call to the consumer's assignment;
        the topic partitions it now fetches."""
        with self._lock:
            to_fetch, self._to_fetch = self._to_fetch, deque()
        started: list[Position] = []
        for partition, starts in to_fetch:
            consumer.incremental_assign(
                [TopicPartition(self._topics.name(k), partition, starts[k]) for k in KINDS]
            )
            self._fetching.add(partition)
            started.extend((k, partition) for k in KINDS)
        return started

    def polled(self, consumer: Consumer) -> None:
        """After each poll: wake the fetchers if a rebalance callback ran in it."""
        if self._rebalanced:
            self._rebalanced = False
            self._wake_fetchers(consumer)

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

    def assigned(self, consumer: Consumer, assigned: list[TopicPartition]) -> None:
        """The consumer's ``on_assign``."""
        # Acknowledged with nothing to fetch yet: each partition is fetched once restored
        # (``fetch``), from the offsets its state covers.
        consumer.incremental_assign([])
        # Wake the fetchers once this poll returns. Not after a revoke: an assign (of
        # none, maybe) always follows it, with the partitions paused again until then,
        # and a seek while paused does not wake them.
        self._rebalanced = True
        partitions = sorted(tp.partition for tp in assigned if tp.topic in self._kind_of)
        if self._failed():
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

    def revoked(self, consumer: Consumer, revoked: list[TopicPartition]) -> None:
        """The consumer's ``on_revoke``: drain the partitions, then give them up."""
        partitions = sorted({tp.partition for tp in revoked})
        log.info("group revoked partitions", extra={"partitions": partitions})
        began = time.monotonic()
        try:
            self._call(self._on_revoke(partitions))
        except BaseException as exc:
            log.exception("giving up partitions failed", extra={"partitions": partitions})
            self._fail(exc)
        self._offsets.commit(consumer, asynchronous=False, only=set(partitions))
        self._stop_fetching(consumer, partitions)
        # Fetching for every other partition stood still meanwhile.
        log.info(
            "gave up partitions in %.3f s",
            time.monotonic() - began,
            extra={"partitions": partitions},
        )

    def lost(self, consumer: Consumer, lost: list[TopicPartition]) -> None:
        """The consumer's ``on_lost``: give the partitions up at once."""
        partitions = sorted({tp.partition for tp in lost})
        log.warning("group lost partitions (session timed out?)", extra={"partitions": partitions})
        self._offsets.forget(partitions)
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
