"""Restore: rebuild a partition's state from its history records.

Used when local state is missing or behind the history topic (a new owner, an empty
state directory, a crash between producing records and writing state). Records are
folded with the same ``InstanceState.apply`` the processor uses, so restored state is
the state that was lost. Records of an older epoch that follow a newer fence were
written by a deposed owner and are skipped; records at or below an instance's sequence
are already applied and change nothing.
"""

from __future__ import annotations

import logging

from consumers import state_keys as keys
from consumers.partition import load_state, write_state
from engine.errors import UndecodableRecord
from engine.records import HistoryRecord, PartitionFenced
from engine.seams import CommitBatch, StateStore
from engine.serde import RecordSerde
from engine.state import InstanceState

log = logging.getLogger("stepstream.restore")


class Restorer:
    def __init__(self, store: StateStore, serde: RecordSerde) -> None:
        self._store = store
        self._serde = serde
        self._states: dict[str, InstanceState] = {}
        self._history: dict[bytes, bytes] = {}
        self.fence_epoch = 0
        self.applied = 0
        self.skipped = 0

    def apply(self, value: bytes) -> None:
        try:
            record = self._serde.decode(value)
        except UndecodableRecord as exc:
            log.error("restore: skipping undecodable history record: %s", exc)
            self.skipped += 1
            return
        if isinstance(record, PartitionFenced):
            self.fence_epoch = max(self.fence_epoch, record.epoch)
            return
        if not isinstance(record, HistoryRecord) or record.epoch < self.fence_epoch:
            self.skipped += 1
            return
        state = self._states.get(record.instance_id)
        if state is None:
            state = load_state(self._store, record.instance_id) or InstanceState(record.instance_id)
            self._states[record.instance_id] = state
        if record.seq <= state.seq:
            return
        if record.seq != state.seq + 1:
            log.warning(
                "restore: instance %s jumps from seq %d to %d; history is incomplete",
                record.instance_id,
                state.seq,
                record.seq,
            )
        state.apply(record)
        self._history[keys.history(record.instance_id, record.seq)] = value
        self.applied += 1

    def batch(self) -> CommitBatch:
        """The state changes so far, as one batch; resets the pending changes."""
        batch = CommitBatch()
        for key, value in self._history.items():
            batch.put(key, value)
        for state in self._states.values():
            write_state(state, batch)
        self._history.clear()
        self._states.clear()
        return batch
