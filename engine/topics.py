"""Topic names and partitioning: the one place that formats internal names."""

from __future__ import annotations

import functools
from dataclasses import dataclass

COMMANDS = "commands"
HISTORY = "history"
TIMERS = "timers"
DEAD_LETTERS = "dead-letters"
MEMBERS = "members"
DEFINITIONS = "definitions"
SNAPSHOTS = "snapshots"
TOPIC_KINDS = (COMMANDS, HISTORY, TIMERS, DEAD_LETTERS, SNAPSHOTS)
DEFAULT_PREFIX = "stepstream"


@dataclass(frozen=True, slots=True)
class TopicNames:
    prefix: str = DEFAULT_PREFIX

    def name(self, kind: str) -> str:
        return f"{self.prefix}.{kind}"

    @property
    def commands(self) -> str:
        return self.name(COMMANDS)

    @property
    def history(self) -> str:
        return self.name(HISTORY)

    @property
    def timers(self) -> str:
        return self.name(TIMERS)

    @property
    def dead_letters(self) -> str:
        return self.name(DEAD_LETTERS)

    @property
    def snapshots(self) -> str:
        return self.name(SNAPSHOTS)


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (the Java client's default partitioner), so every client and every
    backend agrees on which partition owns an instance."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = (
            (data[i4] & 0xFF)
            | ((data[i4 + 1] & 0xFF) << 8)
            | ((data[i4 + 2] & 0xFF) << 16)
            | ((data[i4 + 3] & 0xFF) << 24)
        )
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    extra = length % 4
    index = length4 * 4
    if extra >= 3:
        h ^= (data[index + 2] & 0xFF) << 16
    if extra >= 2:
        h ^= (data[index + 1] & 0xFF) << 8
    if extra >= 1:
        h ^= data[index] & 0xFF
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


@functools.lru_cache(maxsize=65536)
def partition_for(instance_id: str, partitions: int) -> int:
    return (murmur2(instance_id.encode()) & 0x7FFFFFFF) % partitions
