"""Source lag: per source topic partition, how many records are not yet durable commands.

Exposed as ``stepstream_source_lag_records{topic,partition}``: a metrics module reads
``SourceLag.records()`` (``KafkaWorker.source_lag``); the sources consumer also logs it.
Lag is the partition's high watermark minus the next offset whose command is not yet
acknowledged by the broker, the offset the group commits.
"""

from __future__ import annotations

import threading

METRIC_NAME = "stepstream_source_lag_records"

TopicPartitionKey = tuple[str, int]


class SourceLag:
    """Lag per ``(topic, partition)`` of the partitions this worker consumes now. Written
    by the sources consumer, read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[TopicPartitionKey, int] = {}

    def set(self, topic: str, partition: int, records: int) -> None:
        with self._lock:
            self._records[(topic, partition)] = max(0, records)

    def drop(self, topic: str, partition: int) -> None:
        """A partition handed to another worker: its lag is theirs to report."""
        with self._lock:
            self._records.pop((topic, partition), None)

    def records(self) -> dict[TopicPartitionKey, int]:
        """A copy: ``{(topic, partition): records behind}``."""
        with self._lock:
            return dict(self._records)

    def total(self) -> int:
        with self._lock:
            return sum(self._records.values())

    def describe(self) -> str:
        """``topic[p]=n`` pairs, for logs."""
        return " ".join(f"{t}[{p}]={n}" for (t, p), n in sorted(self.records().items()))
