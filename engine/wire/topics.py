"""Topic names and partitioning: the one place that formats internal names."""

from __future__ import annotations

import functools
import struct
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
    m = 0x5BD1E995
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    whole = length >> 2
    for k in struct.unpack_from(f"<{whole}I", data):  # little-endian 4-byte words
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        h = ((h * m) & 0xFFFFFFFF) ^ ((k * m) & 0xFFFFFFFF)
    extra = length & 3
    index = whole * 4
    if extra >= 3:
        h ^= data[index + 2] << 16
    if extra >= 2:
        h ^= data[index + 1] << 8
    if extra >= 1:
        h ^= data[index]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


# Sized for the instances a process keeps live (10,000 by default), which are the ones
# asked for again and again; each entry also keeps its id alive, about 150 bytes in all,
# so 65,536 entries held 9 MB once that many ids had come by (tracemalloc).
@functools.lru_cache(maxsize=16384)
def partition_for(instance_id: str, partitions: int) -> int:
    return (murmur2(instance_id.encode()) & 0x7FFFFFFF) % partitions
