"""One in-memory fake per seam of ``engine/seams.py``, for tests that run a piece of the
engine (a runtime, a hook runner) without a backend: the clock, a partition's state
store, and a partition backend that commits into that store. And, for fault tests on a
real backend, ``CommitFaults``: a partition as it is but for the commits a test breaks.

A test that runs the whole engine uses the product's ``VirtualClock``
(``stepstream.testing``) instead: its ``sleep`` waits until the clock is moved on, which
the timer service needs. Nothing sleeps on ``FakeClock``: its tests drive a runtime by
hand and move the clock themselves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepstream.engine.seams import CommitBatch, PartitionBackend

T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z: the fakes' "now" unless a test says


class FakeClock:
    """The ``Clock`` seam at ``ms`` (``T0`` unless given), moved only by the test:
    ``advance``, or ``ms`` set outright. ``sleep`` moves it on and returns at once."""

    def __init__(self, ms: int = T0) -> None:
        self.ms = ms

    def now_ms(self) -> int:
        return self.ms

    async def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self.ms += round(seconds * 1000)


@dataclass
class FakeStore:
    """The ``StateStore`` seam over a dict (keys local to the partition, as there)."""

    data: dict[bytes, bytes] = field(default_factory=dict)

    def get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        for key in sorted(self.data):
            if key.startswith(prefix) and (start is None or key >= start):
                yield key, self.data[key]

    def scan_reverse(
        self, prefix: bytes, before: bytes | None = None
    ) -> Iterator[tuple[bytes, bytes]]:
        for key in sorted(self.data, reverse=True):
            if key.startswith(prefix) and (before is None or key < before):
                yield key, self.data[key]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.data.get(key) for key in keys]

    def scan_many(self, prefixes: Sequence[bytes]) -> list[list[tuple[bytes, bytes]]]:
        return [list(self.scan(prefix)) for prefix in prefixes]


@dataclass
class FakeBackend:
    """A partition whose commits apply to a ``FakeStore`` and are kept in ``commits``
    (their appends go nowhere: it has no log)."""

    partition: int = 0
    partitions: int = 1
    epoch: int = 1
    previous_epoch: int = 0
    store: FakeStore = field(default_factory=FakeStore)
    commits: list[CommitBatch] = field(default_factory=list)

    async def commit(self, batch: CommitBatch) -> None:
        self.commits.append(batch)
        for key in batch.deletes:
            self.store.data.pop(key, None)
        self.store.data.update(batch.puts)


class CommitFaults:
    """A partition backend exactly as ``inner`` is, but for ``commit``: a subclass
    overrides it to fail where the test wants, around ``inner.commit``. ``commits``
    counts the commits asked for."""

    def __init__(self, inner: PartitionBackend) -> None:
        self.inner = inner
        self.partition = inner.partition
        self.partitions = inner.partitions
        self.epoch = inner.epoch
        self.store = inner.store
        self.source = inner.source
        self.committed_offset = inner.committed_offset
        self.commits = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # the rest of the partition, as it is

    async def commit(self, batch: CommitBatch) -> None:
        self.commits += 1
        await self.inner.commit(batch)
