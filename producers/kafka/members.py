"""Who owns which partition, at which address: the ``<prefix>.members`` topic.

Every worker keeps one record there, keyed by its worker id, rewritten whenever its
partitions change and deleted (a tombstone) when it stops cleanly::

    {"url": "http://10.0.0.7:8233", "partitions": [0, 3], "epoch": 1795312000123,
     "workflows": {"order": ["1", "2"]}, "partition_count": 12,
     "max_payload_bytes": 1048576, "time_ms": 1795312000456}

``epoch`` is the highest fencing epoch the worker owns its partitions with; when two
records claim a partition (a worker was killed and its record stayed behind), the higher
epoch is the owner. The versions of a workflow end with the one new instances get.

``MembersView`` is a client's live copy of the topic (aiokafka, outside any group): it
follows the topic in the background and wakes whoever waits for an owner to change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from engine.errors import ConnectionFailed, UnknownWorkflow
from engine.workflow import ordered_versions

log = logging.getLogger("stepstream.kafka.members")

_FETCH_WAIT_MS = 100


@dataclass(frozen=True, slots=True)
class Member:
    worker_id: str
    url: str
    partitions: tuple[int, ...]
    epoch: int
    workflows: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    partition_count: int = 0
    max_payload_bytes: int = 0
    time_ms: int = 0

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "url": self.url,
                "partitions": list(self.partitions),
                "epoch": self.epoch,
                "workflows": {name: list(v) for name, v in self.workflows.items()},
                "partition_count": self.partition_count,
                "max_payload_bytes": self.max_payload_bytes,
                "time_ms": self.time_ms,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, worker_id: str, raw: bytes) -> Member | None:
        """The record, or None if it is not one (logged, skipped)."""
        try:
            body = json.loads(raw)
            return cls(
                worker_id=worker_id,
                url=str(body["url"]),
                partitions=tuple(int(p) for p in body.get("partitions", ())),
                epoch=int(body.get("epoch", 0)),
                workflows={
                    str(name): tuple(str(v) for v in versions)
                    for name, versions in dict(body.get("workflows", {})).items()
                },
                partition_count=int(body.get("partition_count", 0)),
                max_payload_bytes=int(body.get("max_payload_bytes", 0)),
                time_ms=int(body.get("time_ms", 0)),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("skipping a malformed members record of %s: %s", worker_id, exc)
            return None


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
class RemoteWorkflow:
    """A workflow some worker runs, and the version new instances get."""

    name: str
    version: str


class MembersView:
    """``await MembersView.open(topic, **aiokafka_options)``; ``await close()``."""

    def __init__(self, consumer: AIOKafkaConsumer, topic: str) -> None:
        self.topic = topic
        self._consumer = consumer
        self._tp = TopicPartition(topic, 0)
        self._members: dict[str, Member] = {}
        self._owners: dict[int, Member] = {}
        self._changed = asyncio.Event()
        self._rounds = 0
        self._round_done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._listeners: list[Callable[[], None]] = []

    @classmethod
    async def open(cls, topic: str, *, timeout: float, **options: Any) -> MembersView:
        consumer = AIOKafkaConsumer(
            **options,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=_FETCH_WAIT_MS,
        )
        await consumer.start()
        view = cls(consumer, topic)
        try:
            consumer.assign([view._tp])
            await consumer.seek_to_beginning(view._tp)
            view._task = asyncio.get_running_loop().create_task(view._follow())
            await view.synced(timeout)
        except BaseException:
            await view.close()
            raise
        return view

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self._consumer.stop()

    # ---- what the topic says ------------------------------------------------------------

    def owner(self, partition: int) -> Member | None:
        return self._owners.get(partition)

    def live(self) -> list[Member]:
        """Members that own at least one partition."""
        unique = {m.worker_id: m for m in self._owners.values()}
        return sorted(unique.values(), key=lambda m: m.worker_id)

    def knows(self, workflow: str, version: str | None = None) -> bool:
        """Whether a live worker runs ``workflow`` (in ``version``, if given)."""
        return any(
            workflow in m.workflows and (version is None or version in m.workflows[workflow])
            for m in self.live()
        )

    def resolve(self, workflow: str, version: str | None = None) -> RemoteWorkflow:
        """The workflow and the version a new instance gets: ``version`` if some live
        worker has it, else (None) the latest; ``UnknownWorkflow`` if none has either."""
        live = self.live()
        knowing = [m for m in live if workflow in m.workflows]
        if not knowing:
            if not live:
                raise UnknownWorkflow(
                    f"unknown workflow {workflow!r}: no worker is running for "
                    f"{self.topic.rsplit('.', 1)[0]!r} (nothing on {self.topic}); start "
                    "`stepstream worker --workflows MODULE ...` first"
                )
            known = ", ".join(sorted({n for m in live for n in m.workflows})) or "none"
            raise UnknownWorkflow(
                f"unknown workflow {workflow!r} (registered: {known}); register it with "
                "@workflow and load its module with the workers' --workflows"
            )
        if version is not None:
            if any(version in m.workflows[workflow] for m in knowing):
                # A worker that lacks it (a rolling deploy) dead-letters the start, saying so.
                return RemoteWorkflow(workflow, version)
            versions = ordered_versions(v for m in knowing for v in m.workflows[workflow])
            raise UnknownWorkflow(
                f"unknown workflow {workflow!r} version {version!r}: no running worker has "
                f"it (versions: {', '.join(versions)}); pin one of those, or deploy that "
                "version with the workers' --workflows"
            )
        # During a rolling deploy the latest announcement decides; a worker that lacks
        # that version dead-letters the start with a message saying so.
        latest = max(knowing, key=lambda m: m.time_ms)
        return RemoteWorkflow(workflow, latest.workflows[workflow][-1])

    @property
    def partition_count(self) -> int:
        counts = {m.partition_count for m in self.live() if m.partition_count}
        return counts.pop() if len(counts) == 1 else 0

    # ---- waiting ------------------------------------------------------------------------

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the loop) whenever the view changes."""
        self._listeners.append(listener)

    async def changed(self, timeout: float) -> bool:
        """Wait until the view changes (True) or ``timeout`` passes (False)."""
        self._check()
        event = self._changed
        try:
            async with asyncio.timeout(max(timeout, 0)):
                await event.wait()
            return True
        except TimeoutError:
            return False

    async def synced(self, timeout: float) -> None:
        """Wait until the view holds every record written before this call."""
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
                    self._apply(record.key, record.value)
                if records:
                    self._owners = owners(self._members)
                    self._changed.set()
                    self._changed = asyncio.Event()
                    for listener in self._listeners:
                        listener()
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

    def _apply(self, key: bytes | None, value: bytes | None) -> None:
        if not key:
            return
        worker_id = key.decode(errors="replace")
        if value is None:
            self._members.pop(worker_id, None)
            return
        member = Member.from_json(worker_id, value)
        if member is not None:
            self._members[worker_id] = member
