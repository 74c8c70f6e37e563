"""What the group consumer's librdkafka statistics tell a worker: whether the group is
steady (the moment to commit offsets), the end of each fetched partition (for consumer
lag), and, to the ``LoginWatch``, whether the consumer is logged in again.

Offsets are committed only right after the statistics show the group steady. A commit
sent during a rebalance waits on the coordinator behind the SyncGroup; when that fails
(another member rejoined), its ILLEGAL_GENERATION answer reaches a member back in
``init`` state, and librdkafka (2.16) declares the whole assignment lost (librdkafka
issue 4059): every partition is given up without a drain and taken over again. Seen in
1 of ~8 joins with commits every 0.2 s.
"""

from __future__ import annotations

import json
import time

from stepstream.consumers.kafka.logins import LoginWatch

# The statistics come this often (``statistics.interval.ms``), so offsets are committed
# at most this often.
STATS_INTERVAL_MS = 250
# Brokers in these states are connected (UPDATE and REAUTH are an UP broker's own).
_CONNECTED = frozenset({"UP", "UPDATE", "REAUTH"})
# Statistics in a row with no broker connected before a worker says Kafka is unreachable
# (about 2 s): longer than a start's handshakes.
UNREACHABLE_SAMPLES = 8


class GroupStatistics:
    """Fed by the consumer's ``stats_cb`` on the poll thread; ``high_watermark`` is read
    from the event loop."""

    def __init__(self, kind_of: dict[str, str], logins: LoginWatch | None) -> None:
        """``kind_of``: topic name -> topic kind, of the topics the group fetches."""
        self._kind_of = kind_of
        self._logins = logins
        self._steady = False  # the last statistics showed the group steady
        # (topic kind, partition) -> the log end offset the last statistics showed.
        self._high_watermarks: dict[tuple[str, int], int] = {}
        # When the statistics first showed no broker up, while none has been since (wall
        # clock, seconds): what a not-ready worker says is keeping it (its /readyz). Said
        # only once UNREACHABLE_SAMPLES in a row agree: a start (connecting, TLS and SASL
        # handshakes) passes through states that are not yet UP.
        self.unreachable_since: float | None = None
        self._none_up = 0  # statistics in a row with no broker connected
        self._none_up_since = 0.0  # when the first of them came

    def heard(self, stats: str) -> None:
        """The ``stats_cb``: librdkafka's statistics, as JSON text."""
        try:
            parsed = json.loads(stats)
        except ValueError:
            return
        if self._logins is not None:
            self._logins.statistics("group", parsed)
        brokers = parsed.get("brokers", {})
        if brokers and not any(b.get("state") in _CONNECTED for b in brokers.values()):
            if not self._none_up:
                self._none_up_since = time.time()
            self._none_up += 1
            if self._none_up >= UNREACHABLE_SAMPLES:
                self.unreachable_since = self._none_up_since
        elif brokers:
            self._none_up = 0
            self.unreachable_since = None
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

    def take_steady(self) -> bool:
        """Whether the statistics heard since the last call showed the group steady (the
        last of them did): then offsets may be committed."""
        steady, self._steady = self._steady, False
        return steady

    def high_watermark(self, kind: str, partition: int) -> int | None:
        """The end of the topic partition as the consumer last heard it (None: not yet)."""
        return self._high_watermarks.get((kind, partition))
