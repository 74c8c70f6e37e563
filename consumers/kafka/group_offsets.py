"""The offsets a worker commits to its consumer group: what the state it has written
covers, kept until the poll thread commits it (asynchronously, a few times a second, and
synchronously for partitions given up and when the worker leaves).

The local state keeps its own offsets; the group's are for a worker that comes without
local state, so a commit that fails only lets the group's copy lag.
"""

from __future__ import annotations

import logging
import threading

from confluent_kafka import Consumer, TopicPartition

from stepstream.engine.wire.topics import TopicNames

log = logging.getLogger("stepstream.kafka.group")

Position = tuple[str, int]  # (topic kind, partition)


class GroupOffsets:
    """Offsets waiting to be committed. ``consumed`` is called from the event loop, the
    rest from the poll thread."""

    def __init__(self, topics: TopicNames) -> None:
        self._topics = topics
        self._lock = threading.Lock()
        self._to_commit: dict[Position, int] = {}

    def consumed(self, kind: str, partition: int, offset: int) -> None:
        """State covering ``kind`` up to ``offset`` is written: commit it (soon)."""
        with self._lock:
            self._to_commit[(kind, partition)] = offset

    def forget(self, partitions: list[int]) -> None:
        """The partitions were lost: another member may own them already, and what this
        worker applied of them is no longer the group's to hear."""
        with self._lock:
            for key in [k for k in self._to_commit if k[1] in partitions]:
                del self._to_commit[key]

    def commit(
        self, consumer: Consumer, *, asynchronous: bool, only: set[int] | None = None
    ) -> None:
        """Commit what is waiting (of the partitions ``only``, if given)."""
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
