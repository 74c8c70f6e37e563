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
        if retention_ms > 0:
            now = self._clock.now_ms()
            cutoff = now - retention_ms
            for key, _ in store.scan(keys.FINISHED):
                finished_ms, instance_id = keys.split_finished(key)
                if finished_ms > cutoff or forgotten >= SWEEP_BATCH:
                    break
                runtime = self._cache.peek(instance_id)
                if runtime is not None and runtime.busy:
                    continue  # an attempt of it still runs: next time
                state = load_state(store, instance_id, entries=False)
                batch.delete(key)
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
            for key, value in store.scan(keys.LOG_MARK):
                if keys.split_log_mark(key) > cutoff:
                    break
                history_before = keys.decode_offset(value)
                batch.delete(key)
            batch.put(keys.log_mark(now), keys.encode_offset(backend.end_offset(HISTORY)))
            self._trim(batch, HISTORY, history_before)
        for kind in (COMMANDS, TIMERS):
            self._trim(batch, kind, backend.committed_offset(kind))
        if forgotten >= SWEEP_BATCH:
            self._last = 0.0  # more are due: sweep again after the next batch
        await backend.commit(batch)
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
