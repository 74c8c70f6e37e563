"""Snapshots of a partition's state on the ``<prefix>.snapshots`` topic, so that a worker
without local state restores from the live state plus the history after it, not from
the whole history.

Writing: once the history a partition's state covers has grown since the last snapshot
by ``every`` records and by as many records as that snapshot held entries, its owner
notes the offsets its state covers and copies the state as it is at those offsets
(RocksDB iterators made together on the loop's thread, one per key family, read while
commits go on), appending ``StateChunk`` records closed by one ``SnapshotTaken`` with
those offsets. A crash or a revoke halfway leaves
chunks without a closing record; readers skip them.

Reading: the newest complete snapshot is the one whose ``SnapshotTaken`` is the last
record of the partition (found by reading from just before the end, so the cost does
not grow with the topic). Its history offset and the CRC-32 of the record before it are
checked against the history topic by restore, as for any local state; a snapshot that
does not match (topics recreated) is discarded the same way. Who wrote a snapshot does
not matter: a deposed owner's state never covers records past a newer fence (its commits
stop at the first gap), so any complete snapshot is a state the history folds from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

from stepstream.consumers import state_keys
from stepstream.consumers.kafka import keys
from stepstream.consumers.kafka.db import PartitionDB
from stepstream.consumers.kafka.producer import LogProducer, OutRecord
from stepstream.consumers.kafka.restore import Headers, HistoryReader
from stepstream.consumers.meta_filter import created_in
from stepstream.engine.errors import UndecodableRecord
from stepstream.engine.replay.state_json import state_from_storage
from stepstream.engine.seams import Clock
from stepstream.engine.wire.records import Record, SnapshotTaken, StateChunk
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.topics import COMMANDS, HISTORY, TIMERS, TopicNames

log = logging.getLogger("stepstream.kafka.snapshots")

DEFAULT_SNAPSHOT_EVERY = 10_000  # history records between snapshots of a partition, at least
CHUNK_BYTES = 256 * 1024


class Snapshotter:
    """Takes the snapshots of one owned partition. ``maybe_take`` after each commit."""

    def __init__(
        self,
        *,
        partition: int,
        every: int,
        producer: LogProducer,
        serde: RecordSerde,
        clock: Clock,
        topics: TopicNames,
        epoch: int,
    ) -> None:
        self.partition = partition
        self.every = every
        self._producer = producer
        self._serde = serde
        self._clock = clock
        self._topic = topics.snapshots
        self._epoch = epoch
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._retry_at = 0
        self.taken = 0

    def maybe_take(self, db: PartitionDB) -> None:
        """Start a snapshot if enough history has accumulated and none is being written."""
        if self.every <= 0 or self.busy or self._stopped:
            return
        history = db.offset(HISTORY) or 0
        if history < self._retry_at:
            return  # the last attempt failed: not again before ``every`` more records
        since = history - (db.offset_meta(keys.META_SNAPSHOT_HISTORY) or 0)
        # At least ``every`` records, and at least as many as the last snapshot held:
        # snapshots cost O(history) in all, and a restore reads at most about twice the
        # live state (the snapshot, then no more history than that).
        if since < max(self.every, db.offset_meta(keys.META_SNAPSHOT_ENTRIES) or 0):
            return
        self._task = asyncio.get_running_loop().create_task(self._write(db))

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    async def finish(self, timeout: float) -> None:
        """On a graceful hand-over: start no new snapshot, and give the one being written
        up to ``timeout`` seconds to complete (a cut-short one is of no use to anyone)."""
        self._stopped = True
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except (TimeoutError, Exception):
                pass

    async def stop(self) -> None:
        """Abandon a snapshot being written (its chunks stay unclosed and are skipped)
        and take no more. Call before the partition's db is closed."""
        self._stopped = True
        if self.busy:
            assert self._task is not None
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _write(self, db: PartitionDB) -> None:
        began = time.monotonic()
        # Where the snapshot starts: every instance is copied at this point or later.
        history = db.offset(HISTORY) or 0
        tail = db.history_tail or 0
        commands = db.offset(COMMANDS) or 0
        timers = db.offset(TIMERS) or 0
        snapshot_id = f"p{self.partition}-{history}-{self._clock.now_ms()}"
        known = db.offset_meta(keys.META_SNAPSHOT_OFFSET)
        previous = -1 if known is None else known
        first: int | None = None
        count = entries = 0
        # The state as it is now (nothing awaited since the offsets were read): the
        # state at those offsets, however long the copy takes.
        view = _StateView(db)
        try:
            async for names, values in view.chunks():
                record = StateChunk(
                    **self._envelope(snapshot_id),
                    index=count,
                    previous_offset=previous,
                    keys=names,
                    values=values,
                )
                [offset] = await self._producer.send([self._out(record)])
                first = offset if first is None else first
                count += 1
                entries += len(names)
            taken = SnapshotTaken(
                **self._envelope(snapshot_id),
                partition=self.partition,
                first_offset=-1 if first is None else first,
                chunks=count,
                entries=entries,
                history_offset=history,
                history_tail=tail,
                commands_offset=commands,
                timers_offset=timers,
            )
            [taken_at] = await self._producer.send([self._out(taken)])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(
                "snapshot %s failed; trying again after %d more history records",
                snapshot_id,
                self.every,
                extra={"partition": self.partition},
            )
            self._retry_at = history + self.every
            return
        finally:
            view.close()  # before the db may close: the view's iterators keep it open
        if not db.closed:
            db.write(
                meta={
                    keys.META_SNAPSHOT_HISTORY: history,
                    keys.META_SNAPSHOT_ENTRIES: entries,
                    keys.META_SNAPSHOT_OFFSET: taken_at,
                }
            )
        self.taken += 1
        log.info(
            "snapshot %s: %d entries in %d chunks, history to %d, in %.3f s",
            snapshot_id,
            entries,
            count,
            history,
            time.monotonic() - began,
            extra={"partition": self.partition},
        )

    def _envelope(self, snapshot_id: str) -> dict[str, Any]:
        return {
            "instance_id": "",
            "time_ms": self._clock.now_ms(),
            "command_id": f"snapshot:{snapshot_id}",
            "epoch": self._epoch,
            "snapshot_id": snapshot_id,
        }

    def _out(self, record: StateChunk | SnapshotTaken) -> OutRecord:
        return OutRecord(self._topic, self.partition, b"", self._serde.encode(record))


_YIELD_EVERY = 2_000  # keys copied between returns to the event loop


class _StateView:
    """A partition's state as it was when made: one RocksDB iterator per key family,
    all made together on the loop's thread, where every write happens, so together
    they are the state at one point of the history (the snapshot's offsets), however
    long the copy takes and whatever is committed meanwhile. Reading family by family
    costs a handful of iterators, not several per instance."""

    def __init__(self, db: PartitionDB) -> None:
        self._scans: list[Generator[tuple[bytes, bytes], None, None]] = []
        try:
            for prefix in (state_keys.META, state_keys.ACTIVE, *state_keys.INSTANCE_FAMILIES):
                self._scans.append(db.pinned_scan(prefix))
        except BaseException:
            self.close()  # a damaged state: let go of the iterators already made
            raise
        self._metas, self._actives, *self._families = self._scans

    def close(self) -> None:
        for scan in self._scans:
            scan.close()

    def _pairs(self) -> Iterator[tuple[bytes, bytes]]:
        """Every instance's meta with its key in the index by created time, and its
        active key, or its finished key for one that finished (the timer index is not
        copied: restore rebuilds it from pending timers); then the mark that the index
        by created time is whole, and each family of per-instance keys whole."""
        at = len(state_keys.ACTIVE)
        active = next(self._actives, None)
        for meta_key, meta in self._metas:
            yield meta_key, meta
            # From the meta, as the finished key: whole even if the store's index is not.
            yield state_keys.started(created_in(meta), state_keys.split_meta(meta_key)), b""
            escaped = meta_key[len(state_keys.META) :]
            # Both families are sorted by the escaped instance id: one pass over each.
            while active is not None and active[0][at:] < escaped:
                active = next(self._actives, None)
            if active is not None and active[0][at:] == escaped:
                yield active
            else:
                instance_id = state_keys.split_meta(meta_key)
                state = state_from_storage(instance_id, meta, [])
                yield state_keys.finished(state.finished_ms, instance_id), b""
        yield state_keys.STARTED_INDEXED, b""
        for family in self._families:
            yield from family

    async def chunks(self) -> AsyncIterator[tuple[list[bytes], list[bytes]]]:
        """The keys and values, in chunks of about ``CHUNK_BYTES`` (an instance may span
        chunks: a chunk stays small)."""
        names: list[bytes] = []
        values: list[bytes] = []
        size = copied = 0
        for key, value in self._pairs():
            pair = len(key) + len(value) + 8
            if names and size + pair > CHUNK_BYTES:
                yield names, values
                names, values, size = [], [], 0
            names.append(key)
            values.append(value)
            size += pair
            copied += 1
            if copied % _YIELD_EVERY == 0:
                await asyncio.sleep(0)
        if names:
            yield names, values


# ---- reading ---------------------------------------------------------------------------


class SnapshotReader:
    """Finds the newest complete snapshot of a partition and loads it into a state store.
    Blocking: call from a thread."""

    def __init__(self, reader: HistoryReader, serde: RecordSerde) -> None:
        self._reader = reader  # a reader of the snapshots topic
        self._serde = serde

    def close(self) -> None:
        self._reader.close()

    def latest(self, partition: int) -> tuple[SnapshotTaken, int] | None:
        """The newest complete snapshot's closing record and its offset, or None: the
        last record of the partition, or, if that is a chunk of a snapshot cut short,
        the complete one its writer knew of."""
        low, end, last = self._reader.tail(partition)
        if end <= low or last is None:
            return None
        record = self._decode(partition, last)
        at = end - 1
        if isinstance(record, StateChunk) and low <= record.previous_offset < end - 1:
            at = record.previous_offset
            found: list[bytes] = []
            self._reader.read(partition, at, at + 1, lambda _o, v, _h: found.append(v))
            record = self._decode(partition, found[0]) if found else None
        if not isinstance(record, SnapshotTaken):
            return None
        if record.chunks and record.first_offset < low:
            return None
        return record, at

    def _decode(self, partition: int, value: bytes) -> Record | None:
        try:
            return self._serde.decode(value)
        except UndecodableRecord as exc:
            log.warning("an unreadable snapshot record: %s", exc, extra={"partition": partition})
            return None

    def load(self, partition: int, db: PartitionDB) -> SnapshotTaken | None:
        """Write the newest complete snapshot into the (empty) ``db`` with the offsets it
        covers. None if there is none or it cannot be read whole; ``db`` may then hold
        part of it and must be wiped."""
        found = self.latest(partition)
        if found is None:
            return None
        taken, stop = found
        loaded = 0

        def apply(_offset: int, value: bytes, _headers: Headers) -> None:
            nonlocal loaded
            try:
                record = self._serde.decode(value)
            except UndecodableRecord:
                return
            if not isinstance(record, StateChunk) or record.snapshot_id != taken.snapshot_id:
                return  # a chunk of a snapshot that was cut short
            if record.index == loaded:
                db.write(puts=zip(record.keys, record.values, strict=True))
                loaded += 1

        if taken.chunks:
            self._reader.read(partition, taken.first_offset, stop, apply)
        if loaded != taken.chunks:
            log.warning(
                "snapshot %s has %d of its %d chunks; not used",
                taken.snapshot_id,
                loaded,
                taken.chunks,
                extra={"partition": partition},
            )
            return None
        db.write(
            # No timers offset: the index is rebuilt by restore, which then sets it.
            offsets={HISTORY: taken.history_offset, COMMANDS: taken.commands_offset},
            history_tail=taken.history_tail,
            # The writer's epoch: the newest fence before history_offset (an owner's
            # commits stop at the first record of a newer one).
            epoch=taken.epoch,
            meta={
                keys.META_SNAPSHOT_HISTORY: taken.history_offset,
                keys.META_SNAPSHOT_ENTRIES: taken.entries,
                keys.META_SNAPSHOT_TIMERS: taken.timers_offset,
                keys.META_SNAPSHOT_OFFSET: stop,
            },
        )
        return taken
