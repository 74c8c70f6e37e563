"""Taking over a partition: fence it, and bring its local state up to the history topic.

1. Read the history partition from the offset the local state covers (or 0) to its end
   (``_PARTITION_EOF``; the broker's ListOffsets answer is not trusted) and fold it with
   ``consumers.restore.Restorer``. The record just before that offset must be the one the
   state remembers; if it is not, the topics are not the ones the state was made from, and
   the state is discarded and rebuilt from offset 0.
2. Choose an epoch above every fence seen, above the state's own, and at least the wall
   clock in ms (so that an owner whose fence is still in flight, invisible here, most
   likely has a lower one), and append a ``PartitionFenced`` with it.
3. Read on up to that fence and fold what a deposed owner appended in the meantime.
   Records of lower epochs after the fence are ignored by every reader, so from here the
   history this state folds is exactly the history every later reader will fold.
4. Write the folded state with the offsets it covers: history up to the fence; commands
   from where the folded history says its commands ended (a header on the last history
   record of each commit), or the group's committed offset, whichever is further; timers
   from the state's own offset or the group's. Timers that restored instances still wait
   on are put back into the timer index (a duplicate fire is harmless; a lost one is not).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from confluent_kafka import Consumer, KafkaError, TopicPartition

from stepstream.consumers import index_marks, state_keys
from stepstream.consumers.instance_store import load_state
from stepstream.consumers.kafka import keys
from stepstream.consumers.kafka.clients import make_client, through_elections
from stepstream.consumers.kafka.db import PartitionDB
from stepstream.consumers.kafka.librdkafka_log import quiet_librdkafka
from stepstream.consumers.kafka.producer import LogProducer, OutRecord
from stepstream.consumers.restore import Restorer
from stepstream.consumers.timers import index_entries
from stepstream.engine.config.kafka import KafkaSettings
from stepstream.engine.errors import StepstreamError
from stepstream.engine.seams import Clock
from stepstream.engine.wire.records import PartitionFenced
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.topics import COMMANDS, HISTORY, TIMERS, TopicNames

if TYPE_CHECKING:
    from stepstream.consumers.kafka.snapshots import SnapshotReader

log = logging.getLogger("stepstream.kafka.restore")

READER_REQUIRED: dict[str, object] = {
    "enable.auto.commit": False,
    "enable.partition.eof": True,
    "auto.offset.reset": "error",
    "allow.auto.create.topics": False,
}
READER_DEFAULTS: dict[str, object] = {"fetch.wait.max.ms": 5, "fetch.min.bytes": 1}
_STALL_S = 60.0
_FENCE_TRIES = 5

Headers = list[tuple[str, str | bytes | None]] | dict[str, str | bytes | None] | None
OnRecord = Callable[[int, bytes, Headers], None]


class RestoreFailed(StepstreamError):
    """The history topic could not be read back."""


@dataclass(frozen=True, slots=True)
class Restored:
    epoch: int
    # The local state's epoch before the restore: that of the owner that last wrote it.
    previous_epoch: int
    # Where the group consumer starts: topic kind -> next offset.
    starts: dict[str, int]
    records: int  # history records folded
    seconds: float
    snapshot: str | None = None  # the id of the snapshot the state started from


class HistoryReader:
    """A consumer outside the group (assign + seek; no join) that reads one history
    partition at a time. Blocking: call from a thread, one read at a time."""

    def __init__(
        self, settings: KafkaSettings, kind: str = HISTORY, *, quiet: bool = False
    ) -> None:
        """``quiet``: librdkafka's lines through Python's logging, without one per
        refused login (a worker's readers: its ``LoginWatch`` reports those)."""
        self._topic = TopicNames(settings.prefix).name(kind)
        quieted: dict[str, object] = {"logger": quiet_librdkafka()} if quiet else {}
        config = settings.client_config(
            "consumer",
            {**READER_DEFAULTS, "client.id": f"stepstream-restore-{kind}"},
            {**READER_REQUIRED, "group.id": f"{settings.prefix}.restore", **quieted},
        )
        self._consumer = make_client(Consumer, config, "restore consumer")

    def end(self, partition: int) -> tuple[int, int]:
        """The first and the next offset of the partition. The broker's ListOffsets
        answer may place the end at the start of the last record batch
        (docs/kafka-notes.md), so the end is found by reading from just before it."""
        low, end, _ = self.tail(partition)
        return low, end

    def tail(self, partition: int) -> tuple[int, int, bytes | None]:
        """The first and the next offset of the partition, and its last record's value."""
        low, high = through_elections(
            lambda: self._consumer.get_watermark_offsets(
                TopicPartition(self._topic, partition), timeout=10, cached=False
            ),
            f"reading the ends of {self._topic}[{partition}]",
        )
        last: list[bytes] = []

        def keep(_offset: int, value: bytes, _headers: Headers) -> None:
            last[:] = [value]

        end = self.read(partition, max(high - 1, low), None, keep)
        return low, end, (last[0] if last else None)

    def read(self, partition: int, start: int, stop_at: int | None, on_record: OnRecord) -> int:
        """Feed records from ``start`` on to ``on_record``; stop at the end of the
        partition, or once the record before ``stop_at`` is read. Returns the next offset.
        """
        consumer = self._consumer
        consumer.assign([TopicPartition(self._topic, partition, start)])
        position = start
        quiet_since = time.monotonic()
        try:
            while stop_at is None or position < stop_at:
                msg = consumer.poll(0.5)
                if msg is None:
                    if time.monotonic() - quiet_since > _STALL_S:
                        raise RestoreFailed(
                            f"reading {self._topic}[{partition}] from offset {position} made "
                            f"no progress for {_STALL_S:.0f} s: is the broker reachable?"
                        )
                    continue
                quiet_since = time.monotonic()
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if stop_at is None:
                            return max(position, msg.offset() or 0)
                        continue
                    if err.retriable():
                        continue  # librdkafka fetches again once the partition has a leader
                    raise RestoreFailed(f"reading {self._topic}[{partition}] failed: {err.str()}")
                offset = msg.offset() or 0
                on_record(offset, msg.value() or b"", msg.headers())
                position = offset + 1
            return position
        finally:
            consumer.unassign()

    def close(self) -> None:
        self._consumer.close()


class _NotThisHistory(Exception):
    """The history topic does not hold the record the local state ends with."""


class _Fold:
    """Folds history records into a Restorer and notes what they say about offsets."""

    def __init__(self, db: PartitionDB, serde: RecordSerde, start: int, fence_epoch: int) -> None:
        self.restorer = Restorer(db, serde)
        self.restorer.fence_epoch = fence_epoch
        self.start = start
        self.expected_tail = db.history_tail
        self.commands: int | None = None
        self.tail: int | None = None
        self.before_start: tuple[int, int] | None = None
        self.records = 0

    @property
    def matches(self) -> bool:
        """Whether the record before ``start`` is the one the state says it covers."""
        return self.start == 0 or self.before_start == (self.start - 1, self.expected_tail)

    def __call__(self, offset: int, value: bytes, headers: Headers) -> None:
        crc = zlib.crc32(value)
        if offset < self.start:
            self.before_start = (offset, crc)
            return
        if self.records == 0 and not self.matches:
            # Not the history this state was made from: folding it would be nonsense.
            raise _NotThisHistory
        self.restorer.apply(value)
        self.records += 1
        self.tail = crc
        pairs = headers.items() if isinstance(headers, dict) else headers or ()
        for name, raw in pairs:
            if name == keys.HEADER_OFFSETS and isinstance(raw, bytes):
                found = keys.decode_offsets_header(raw)
                # A deposed owner's records after a newer fence were skipped: so are
                # the offsets they claim.
                if found is not None and found[0] >= self.restorer.fence_epoch:
                    self.commands = max(self.commands or 0, found[1])


async def restore_partition(
    db: PartitionDB,
    partition: int,
    *,
    reader: HistoryReader,
    producer: LogProducer,
    serde: RecordSerde,
    clock: Clock,
    topics: TopicNames,
    group_offsets: dict[str, int | None],
    snapshots: SnapshotReader | None = None,
) -> tuple[PartitionDB, Restored]:
    """Fence ``partition`` and bring ``db`` up to its history. Returns the db (a new one
    if the old state had to be discarded) and what the restore decided. Without local
    state, the newest snapshot (if any) is loaded first, so only the history after it is
    folded."""
    began = time.monotonic()
    snapshot: str | None = None
    if snapshots is not None and db.offset(HISTORY) is None:
        if not db.empty:  # what an interrupted load left behind
            db = await asyncio.to_thread(db.wiped)
        taken = await asyncio.to_thread(snapshots.load, partition, db)
        if taken is not None:
            snapshot = taken.snapshot_id
        elif not db.empty:
            db = await asyncio.to_thread(db.wiped)  # a snapshot that could not be read whole
    start = db.offset(HISTORY) or 0
    low, end = await asyncio.to_thread(reader.end, partition)
    if low > 0:
        raise RestoreFailed(
            f"{topics.history}[{partition}] starts at offset {low}: records were deleted "
            "(retention), so instance state cannot be rebuilt from it; the history topic "
            "must keep records forever (retention.ms=-1, as `stepstream topics create` sets)"
        )
    fold = _Fold(db, serde, start, db.epoch)
    previous_epoch = db.epoch
    if start > end:
        reason = f"it ends at offset {end}, before the local state's {start}"
    else:
        reason = f"it holds another record at offset {start - 1}"
        try:
            end = await asyncio.to_thread(reader.read, partition, max(start - 1, 0), None, fold)
        except _NotThisHistory:
            pass
    if not fold.matches:
        log.warning(
            "local state covers history up to offset %d, but %s[%d]: %s; the topics were "
            "recreated or lost: discarding the local state and restoring from offset 0",
            start,
            topics.history,
            partition,
            reason,
            extra={"partition": partition},
        )
        db = await asyncio.to_thread(db.wiped)
        start = 0
        snapshot = None
        previous_epoch = 0
        fold = _Fold(db, serde, 0, 0)
        end = await asyncio.to_thread(reader.read, partition, 0, None, fold)

    epoch = max(fold.restorer.fence_epoch + 1, db.epoch + 1, clock.now_ms())
    for _ in range(_FENCE_TRIES):
        fence = PartitionFenced(
            instance_id="",
            time_ms=clock.now_ms(),
            command_id=f"fence:{epoch}",
            epoch=epoch,
            partition=partition,
        )
        [fence_offset] = await producer.send(
            [OutRecord(topics.history, partition, b"", serde.encode(fence))]
        )
        end = await asyncio.to_thread(reader.read, partition, end, fence_offset + 1, fold)
        if fold.restorer.fence_epoch == epoch:
            break
        # Another owner fenced higher between our read and our fence: ours is void.
        log.warning(
            "a fence of epoch %d landed before ours (%d); fencing again",
            fold.restorer.fence_epoch,
            epoch,
            extra={"partition": partition},
        )
        epoch = max(fold.restorer.fence_epoch + 1, clock.now_ms())
    else:
        raise RestoreFailed(
            f"{topics.history}[{partition}]: another worker keeps fencing this partition "
            f"({_FENCE_TRIES} tries); are two consumer groups using prefix {topics.prefix!r}?"
        )

    batch = fold.restorer.batch()
    touched = [state_keys.split_meta(key) for key in batch.puts if key.startswith(state_keys.META)]
    local_timers = db.offset(TIMERS)
    # A state loaded from a snapshot has no timer index yet: the snapshot's offset says
    # where the timers topic resumes once the index is rebuilt from the instances.
    snapshot_timers = db.offset_meta(keys.META_SNAPSHOT_TIMERS) if local_timers is None else 0
    starts = {
        COMMANDS: max(
            db.offset(COMMANDS) or 0, fold.commands or 0, group_offsets.get(COMMANDS) or 0
        ),
        TIMERS: max(local_timers or 0, snapshot_timers or 0, group_offsets.get(TIMERS) or 0),
    }
    # An index's mark moves to this owner's epoch with the epoch itself when the index is
    # whole: the fold keeps both indexes for what it folds, so one the previous writer of
    # this state found whole still is (and an owner revoked before it resumes leaves a
    # mark its successor trusts, not a scan of every meta).
    whole = index_marks.mark(epoch)
    kept = index_marks.mark(previous_epoch)
    started_mark = db.get(state_keys.STARTED_INDEXED)
    if start == 0 or snapshot is not None or db.get(state_keys.FINISHED_INDEXED) == kept:
        # Built whole by this version: every finished instance is in the finish index.
        batch.put(state_keys.FINISHED_INDEXED, whole)
    if (
        (start == 0 and snapshot is None)
        or (snapshot is not None and started_mark is not None)
        or started_mark == kept
    ):
        # Every instance is in the index by created time too (a snapshot brings that
        # index's mark along if its writer kept the index; else the owner builds it).
        batch.put(state_keys.STARTED_INDEXED, whole)
    # The timers offset moves only together with the index that covers it (below), so a
    # crash in between leaves a state whose next restore rebuilds the index again.
    db.write(
        puts=batch.puts.items(),
        deletes=batch.deletes,
        offsets={HISTORY: end, COMMANDS: starts[COMMANDS]},
        epoch=epoch,
        history_tail=fold.tail,
    )
    rebuild = snapshot is not None or starts[TIMERS] > (local_timers or 0)
    if rebuild:
        # Timer records this state never indexed are skipped (another owner indexed
        # them), or the state came from a snapshot (which has no timer index): every
        # unfinished instance's timers come from its state instead.
        reindex = [state_keys.split_active(key) for key, _ in db.scan(state_keys.ACTIVE)]
    else:
        reindex = touched
    timers = _reindex_timers(db, reindex, timers_offset=starts[TIMERS], replace=rebuild)
    seconds = time.monotonic() - began
    log.info(
        "restored in %.3f s",
        seconds,
        extra={
            "partition": partition,
            "epoch": epoch,
            "snapshot": snapshot,
            "history_from": start,
            "history_to": end,
            "records": fold.records,
            "instances": len(touched),
            "timers": timers,
            "commands_from": starts[COMMANDS],
            "timers_from": starts[TIMERS],
        },
    )
    return db, Restored(epoch, previous_epoch, starts, fold.records, seconds, snapshot)


def _reindex_timers(
    db: PartitionDB, instance_ids: list[str], *, timers_offset: int, replace: bool
) -> int:
    """Put the timers that ``instance_ids`` wait on into the timer index (all of it anew
    with ``replace``), in one write with the timers offset the index then covers."""
    puts: list[tuple[bytes, bytes]] = []
    deletes: list[bytes] = []
    if replace:
        deletes = [
            key
            for prefix in (state_keys.TIMER, state_keys.TIMER_BY_ID)
            for key, _ in db.scan(prefix)
        ]
    for instance_id in instance_ids:
        state = load_state(db, instance_id)
        if state is None or state.status.finished:
            continue
        for entry in state.pending_timers():
            assert entry.timer_id is not None and entry.fire_at_ms is not None
            puts.extend(index_entries(entry.fire_at_ms, entry.timer_id, instance_id))
    db.write(puts=puts, deletes=deletes, offsets={TIMERS: timers_offset})
    return len(puts) // 2
