"""A client's live copy of a one-partition compacted topic (``<prefix>.members``,
``<prefix>.definitions``), followed in the background with aiokafka outside any group.

``TopicFollower`` hands each record (key, value or None for a tombstone, broker timestamp)
to its ``apply`` callback, and wakes whoever waits for the copy to change (``changed``) or
to hold everything written before a call (``synced``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from stepstream.engine.errors import ConnectionFailed

log = logging.getLogger("stepstream.kafka.follower")

_FETCH_WAIT_MS = 100
# How long closing waits for the broker to answer the TLS goodbye (close_notify). Under
# uvloop a TLS connection closed while a fetch is in flight can wait its whole
# ssl_shutdown_timeout (30 s) for an answer that never comes; a follower only reads, so
# nothing is lost by cutting its connections after this.
_CLOSE_TIMEOUT_S = 2.0

# (key, value or None for a tombstone, the record's timestamp in ms)
Apply = Callable[[bytes, bytes | None, int], None]


class TopicFollower:
    """``await TopicFollower.open(topic, apply, timeout=, **aiokafka_options)``;
    ``await close()``."""

    def __init__(self, consumer: AIOKafkaConsumer, topic: str, apply: Apply) -> None:
        self.topic = topic
        self._consumer = consumer
        self._apply = apply
        self._tp = TopicPartition(topic, 0)
        self._changed = asyncio.Event()
        self._rounds = 0
        self._round_done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._listeners: list[Callable[[], None]] = []

    @classmethod
    async def open(
        cls, topic: str, apply: Apply, *, timeout: float, **options: Any
    ) -> TopicFollower:
        consumer = AIOKafkaConsumer(
            **options,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=_FETCH_WAIT_MS,
        )
        try:
            await consumer.start()
        except BaseException:
            # A start that failed half-way (the cluster refused or did not answer) may
            # hold connections already: closed here, not left to the garbage collector.
            await stop_reader(consumer)
            raise
        follower = cls(consumer, topic, apply)
        try:
            consumer.assign([follower._tp])
            await consumer.seek_to_beginning(follower._tp)
            follower._task = asyncio.get_running_loop().create_task(follower._follow())
            await follower.synced(timeout)
        except BaseException:
            await follower.close()
            raise
        return follower

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await stop_reader(self._consumer)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the loop) after every batch of records applied."""
        self._listeners.append(listener)

    async def changed(self, timeout: float) -> bool:
        """Wait until the copy changes (True) or ``timeout`` passes (False)."""
        self._check()
        event = self._changed
        try:
            async with asyncio.timeout(max(timeout, 0)):
                await event.wait()
            return True
        except TimeoutError:
            return False

    async def synced(self, timeout: float) -> None:
        """Wait until the copy holds every record written before this call."""
        self._check()
        target = self._rounds + 2  # a whole fetch that began after this call
        try:
            async with asyncio.timeout(timeout):
                while self._rounds < target:
                    self._check()
                    await self._round_done.wait()
        except TimeoutError:
            raise ConnectionFailed(
                f"could not read {self.topic} within {timeout} s; check the bootstrap "
                "servers and security settings"
            ) from None

    def _check(self) -> None:
        if self._failure is not None:
            raise ConnectionFailed(f"reading {self.topic} failed: {self._failure}")

    async def _follow(self) -> None:
        consumer, tp = self._consumer, self._tp
        try:
            while True:
                batch = await consumer.getmany(tp, timeout_ms=_FETCH_WAIT_MS * 2)
                records = batch.get(tp, [])
                for record in records:
                    if record.key:
                        self._apply(record.key, record.value, int(record.timestamp or 0))
                if records:
                    for listener in self._listeners:
                        listener()
                    self._changed.set()
                    self._changed = asyncio.Event()
                highwater = consumer.highwater(tp)
                if highwater is not None and await consumer.position(tp) >= highwater:
                    self._rounds += 1
                    self._round_done.set()
                    self._round_done = asyncio.Event()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("following %s failed", self.topic)
            self._failure = exc
            self._changed.set()
            self._round_done.set()
            raise


async def stop_reader(consumer: AIOKafkaConsumer) -> None:
    """``consumer.stop()``, at most ``_CLOSE_TIMEOUT_S``: past that, its connections are
    aborted (for a consumer outside any group, which has nothing left to write)."""
    # aiokafka drops a connection's writer when it closes it: take the transports first.
    connections = getattr(getattr(consumer, "_client", None), "_conns", {})
    writers = [getattr(conn, "_writer", None) for conn in list(connections.values())]
    transports = [w.transport for w in writers if w is not None]
    try:
        async with asyncio.timeout(_CLOSE_TIMEOUT_S):
            await consumer.stop()
    except TimeoutError:
        log.debug("closing the consumer took over %s s: aborting its connections", _CLOSE_TIMEOUT_S)
        for transport in transports:
            transport.abort()
