"""``KafkaSource``: the records of one topic partition that the group consumer fetches
for an owned partition, buffered on the event loop for the partition's processor or timer
service (the engine's ``Source`` seam), with the flow control and rewinds that go back to
the consumer's poll thread."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from stepstream.engine.seams import LogEntry

# Buffered records of one source before its fetching pauses, and the level at which it
# resumes. A processor takes at most 1,000 a batch, so 10,000 keep it busy through
# a fetch round trip; more only sat in memory: at 50,000 a worker taking a burst of
# starts held 50,000 decoded records per source, and the collector walked them all.
_PAUSE_ABOVE = 10_000
_RESUME_BELOW = 2_000


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
        # The partition's end as the consumer last reached it (librdkafka's partition
        # EOF), heard only once fetching from this source's position has (re)started:
        # an end reached before that belongs to an earlier assignment or position.
        self._end: int | None = None
        self._fetching = False

    def rewind(self, offset: int) -> None:
        """Deliver again from ``offset``: drop what is buffered and seek the consumer."""
        self._buffer.clear()
        self.position = self._next = offset
        self._end, self._fetching = None, False  # until the consumer seeks there
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

    def started(self) -> None:
        """Loop side: the consumer now fetches from this source's position."""
        self._end, self._fetching = None, True

    def reached_end(self, offset: int) -> None:
        """Loop side: the consumer reached the end of the partition, at ``offset``."""
        if self._fetching:
            self._end = offset

    def end_heard(self) -> int | None:
        end = self._end
        return end if end is not None and end >= self._next else None

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
