"""Who owns which partition, at which address: the ``<prefix>.members`` topic.

Every worker keeps one ``MemberAnnounced`` record there (Avro, ``engine.wire.cluster_serde``),
keyed by its worker id, rewritten whenever its partitions change and deleted (a tombstone)
when it stops cleanly. ``epoch`` is the highest fencing epoch the worker owns its
partitions with; when two records claim a partition (a worker was killed and its record
stayed behind), the higher epoch is the owner. A record that is not such an Avro record
(the JSON announcements of older versions, left on the compacted topic) is skipped with a
log line.

``MembersView`` is a client's live copy of the topic: it knows each partition's owner and,
for a partition without one, which worker last had it and since when.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stepstream.engine.errors import UndecodableRecord
from stepstream.engine.wire.cluster_serde import MEMBER_ANNOUNCED, cluster_serde
from stepstream.producers.kafka.follower import TopicFollower

log = logging.getLogger("stepstream.kafka.members")


@dataclass(frozen=True, slots=True)
class Member:
    worker_id: str
    url: str
    partitions: tuple[int, ...]
    epoch: int
    partition_count: int = 0
    max_payload_bytes: int = 0
    time_ms: int = 0

    def encode(self) -> bytes:
        return cluster_serde().encode(
            MEMBER_ANNOUNCED,
            {
                "worker_id": self.worker_id,
                "url": self.url,
                "partitions": list(self.partitions),
                "epoch": self.epoch,
                "partition_count": self.partition_count,
                "max_payload_bytes": self.max_payload_bytes,
                "time_ms": self.time_ms,
            },
        )

    @classmethod
    def decode(cls, worker_id: str, raw: bytes) -> Member | None:
        """The record, or None if it is not one (logged, skipped)."""
        try:
            name, body = cluster_serde().decode(raw)
            if name != MEMBER_ANNOUNCED:
                raise UndecodableRecord(f"a {name} record, not {MEMBER_ANNOUNCED}")
        except UndecodableRecord as exc:
            log.warning("skipping a members record of worker %s: %s", worker_id, exc)
            return None
        return cls(
            worker_id=worker_id,
            url=body["url"],
            partitions=tuple(body["partitions"]),
            epoch=body["epoch"],
            partition_count=body["partition_count"],
            max_payload_bytes=body["max_payload_bytes"],
            time_ms=body["time_ms"],
        )


def owners(members: Mapping[str, Member]) -> dict[int, Member]:
    """Partition -> its owner: of the members claiming it, the one with the top epoch."""
    found: dict[int, Member] = {}
    for member in members.values():
        for partition in member.partitions:
            current = found.get(partition)
            if current is None or (member.epoch, member.time_ms) > (current.epoch, current.time_ms):
                found[partition] = member
    return found


@dataclass(frozen=True, slots=True)
class Vacancy:
    """A partition nobody owns: who had it last, and since when (ms since the epoch)."""

    worker_id: str
    since_ms: int


class MembersView:
    """``await MembersView.open(topic, timeout=, **aiokafka_options)``; ``await close()``."""

    def __init__(self) -> None:
        self._members: dict[str, Member] = {}
        self._owners: dict[int, Member] = {}
        self._vacated: dict[int, Vacancy] = {}
        self._follower: TopicFollower | None = None

    @classmethod
    async def open(cls, topic: str, *, timeout: float, **options: Any) -> MembersView:
        view = cls()
        view._follower = await TopicFollower.open(topic, view._apply, timeout=timeout, **options)
        view._follower.on_change(view._recompute)
        view._recompute()
        return view

    @property
    def topic(self) -> str:
        return self._following.topic

    @property
    def _following(self) -> TopicFollower:
        assert self._follower is not None, "use await MembersView.open(...)"
        return self._follower

    async def close(self) -> None:
        if self._follower is not None:
            await self._follower.close()

    # ---- what the topic says ------------------------------------------------------------

    def owner(self, partition: int) -> Member | None:
        return self._owners.get(partition)

    def vacancy(self, partition: int) -> Vacancy | None:
        """For a partition without an owner: who had it last and since when, if known."""
        return None if partition in self._owners else self._vacated.get(partition)

    def announced(self) -> list[Member]:
        """Every member whose announcement stands, owning partitions or not (one that
        stopped cleanly withdrew its own; a killed one's stays)."""
        return sorted(self._members.values(), key=lambda m: m.worker_id)

    def live(self) -> list[Member]:
        """Members that own at least one partition."""
        unique = {m.worker_id: m for m in self._owners.values()}
        return sorted(unique.values(), key=lambda m: m.worker_id)

    @property
    def partition_count(self) -> int:
        counts = {m.partition_count for m in self.live() if m.partition_count}
        return counts.pop() if len(counts) == 1 else 0

    # ---- waiting ------------------------------------------------------------------------

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the loop) whenever the view changes."""
        self._following.on_change(listener)

    async def changed(self, timeout: float) -> bool:
        """Wait until the view changes (True) or ``timeout`` passes (False)."""
        return await self._following.changed(timeout)

    async def synced(self, timeout: float) -> None:
        """Wait until the view holds every record written before this call."""
        await self._following.synced(timeout)

    # ---- following ----------------------------------------------------------------------

    def _apply(self, key: bytes, value: bytes | None, time_ms: int) -> None:
        worker_id = key.decode(errors="replace")
        before = self._members.get(worker_id)
        member = None if value is None else Member.decode(worker_id, value)
        if value is not None and member is None:
            return  # unreadable: skipped, the last good record stands
        if member is None:
            self._members.pop(worker_id, None)
        else:
            self._members[worker_id] = member
        kept = set(member.partitions) if member is not None else set()
        for partition in before.partitions if before is not None else ():
            if partition not in kept:
                self._vacated[partition] = Vacancy(worker_id, time_ms)

    def _recompute(self) -> None:
        self._owners = owners(self._members)
