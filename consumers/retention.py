"""Retention: a partition's housekeeping sweep. Instances that finished longer than the
retention ago are forgotten (every key of theirs, with an ``InstanceForgotten`` record so
whoever folds the history forgets them too), and the backend may drop log records no
longer needed."""

from __future__ import annotations

import logging

from stepstream.consumers import state_keys as keys
from stepstream.consumers.instance_store import forget_instance, load_state
from stepstream.consumers.runtime_cache import RuntimeCache
from stepstream.engine.seams import Append, Clock, CommitBatch, PartitionBackend
from stepstream.engine.wire.records import InstanceForgotten
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.topics import COMMANDS, HISTORY, TIMERS

log = logging.getLogger("stepstream.partition")

SWEEP_BATCH = 1000  # finished instances forgotten per sweep at most
# How often a sweep reads the finished index from its start instead of from where the
# last one stopped, in case a key landed behind that point (a wall clock stepped back by
# more than the retention): such an instance is forgotten late, never kept for ever.
FULL_SCAN_EVERY_S = 600.0


class Sweeper:
    def __init__(
        self,
        backend: PartitionBackend,
        cache: RuntimeCache,
        *,
        serde: RecordSerde,
        clock: Clock,
        retention_s: float,
        interval_s: float,
    ) -> None:
        self._backend = backend
        self._cache = cache
        self._serde = serde
        self._clock = clock
        self._retention_s = retention_s
        self._interval_s = interval_s
        self._last = 0.0
        # Where the next sweep starts reading the finished index and the log marks: the
        # first key the last one kept. Everything before it was deleted, and RocksDB
        # still walks deleted keys until it compacts them away: read from the start each
        # time, a sweep slowed down with every instance retention had forgotten (three
        # quarters of the engine's time at 45,000 forgotten in a minute).
        self._finished_from: bytes | None = None
        self._marks_from: bytes | None = None
        self._full_scan_at = 0.0

    def due(self, now: float) -> bool:
        if self._cache.draining or now - self._last < self._interval_s:
            return False
        self._last = now
        return True

    async def sweep(self) -> int:
        """Housekeeping, in one commit: forget instances that finished longer than the
        retention ago (oldest first, a bounded number per sweep: every key of theirs
        goes), and let the backend drop log records no longer needed: commands and timers
        consumed, history older than the retention (the log's end offset is noted at
        each sweep, so the offset that old is known). The last record of each log is kept
        (a local log recovers its end offset from it)."""
        backend = self._backend
        store = backend.store
        batch = CommitBatch()
        forgotten = 0
        retention_ms = int(self._retention_s * 1000)
        kept: bytes | None = None  # the first finished key this sweep leaves
        last: bytes | None = None  # the last one it deletes
        marks_kept: bytes | None = None  # the first log mark it leaves
        mark: bytes | None = None  # the one it adds
        if retention_ms > 0:
            now = self._clock.now_ms()
            cutoff = now - retention_ms
            if now >= self._full_scan_at:
                self._full_scan_at = now + FULL_SCAN_EVERY_S * 1000
                self._finished_from = self._marks_from = None
            for key, _ in store.scan(keys.FINISHED, self._finished_from):
                finished_ms, instance_id = keys.split_finished(key)
                if finished_ms > cutoff or forgotten >= SWEEP_BATCH:
                    kept = kept or key
                    break
                runtime = self._cache.peek(instance_id)
                if runtime is not None and runtime.busy:
                    kept = kept or key
                    continue  # an attempt of it still runs: next time
                state = load_state(store, instance_id, entries=False)
                batch.delete(key)
                last = key
                if state is None or state.finished_ms != finished_ms:
                    continue  # a stale index key (the instance is gone, or began anew)
                # Recorded, so that whoever folds this history drops the instance too
                # (and its id may begin a new instance).
                forget = InstanceForgotten(
                    instance_id=instance_id,
                    seq=state.seq + 1,
                    time_ms=now,
                    command_id=f"forget:{instance_id}",
                    epoch=backend.epoch,
                    finished_ms=finished_ms,
                )
                batch.appends.append(
                    Append(
                        HISTORY, instance_id.encode(), self._serde.encode(forget), backend.partition
                    )
                )
                forget_instance(store, instance_id, batch, state)
                self._cache.drop(instance_id)
                forgotten += 1
            history_before = 0
            for key, value in store.scan(keys.LOG_MARK, self._marks_from):
                if keys.split_log_mark(key) > cutoff:
                    marks_kept = key
                    break
                history_before = keys.decode_offset(value)
                batch.delete(key)
            mark = keys.log_mark(now)
            batch.put(mark, keys.encode_offset(backend.end_offset(HISTORY)))
            self._trim(batch, HISTORY, history_before)
        for kind in (COMMANDS, TIMERS):
            self._trim(batch, kind, backend.committed_offset(kind))
        if forgotten >= SWEEP_BATCH:
            self._last = 0.0  # more are due: sweep again after the next batch
        await backend.commit(batch)
        if mark is not None:
            # Only once the deletions are durable: a failed commit leaves them to redo.
            self._finished_from = kept or last or self._finished_from
            self._marks_from = mark if marks_kept is None else min(marks_kept, mark)
        if forgotten:
            log.info(
                "forgot %d instances finished before the retention of %.0f s",
                forgotten,
                self._retention_s,
                extra={"partition": backend.partition},
            )
        return forgotten

    def _trim(self, batch: CommitBatch, kind: str, before: int) -> None:
        keep_last = self._backend.end_offset(kind) - 1
        if min(before, keep_last) > 0:
            batch.trims[kind] = min(before, keep_last)
