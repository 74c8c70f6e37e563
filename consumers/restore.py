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

from stepstream.consumers import state_keys as keys
from stepstream.consumers.instance_store import (
    InstanceReads,
    forget_instance,
    load_state,
    write_state,
)
from stepstream.engine.errors import UndecodableRecord
from stepstream.engine.replay.reset import reset_state
from stepstream.engine.replay.slots import unreleased
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.seams import CommitBatch, StateStore
from stepstream.engine.wire.records import (
    HistoryRecord,
    InstanceForgotten,
    PartitionFenced,
    WorkflowReset,
    WorkflowStarted,
)
from stepstream.engine.wire.serde import RecordSerde

log = logging.getLogger("stepstream.restore")


class Restorer:
    def __init__(self, store: StateStore, serde: RecordSerde) -> None:
        self._store = store
        self._serde = serde
        self._states: dict[str, InstanceState] = {}
        self._history: dict[str, dict[int, bytes]] = {}  # instance -> seq -> record
        # Instances forgotten in what was folded: their stored keys go (queued here), and
        # their stored state is not loaded again.
        self._deletes = CommitBatch()
        self._forgotten: set[str] = set()
        # Instances that a folded record finished while they held or waited for queue
        # slots: their withdrawals may not have been published (``withdraw_again``).
        self._withdraw: set[str] = set()
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
        instance_id = record.instance_id
        state = self._states.get(instance_id)
        if state is None:
            stored = (
                None if instance_id in self._forgotten else load_state(self._store, instance_id)
            )
            state = stored or InstanceState(instance_id)
            self._states[instance_id] = state
        if isinstance(record, InstanceForgotten):
            if record.seq > state.seq:
                self._forget(instance_id)
            return
        if record.seq <= state.seq:
            return
        if state.seq == 0 and not (isinstance(record, WorkflowStarted) and record.seq == 1):
            # Only a WorkflowStarted begins an instance: this is the rest of one that was
            # forgotten (or of a history that does not start at the beginning).
            log.warning(
                "restore: skipping %s seq %d of instance %s, which this state does not hold",
                record.type,
                record.seq,
                instance_id,
            )
            self.skipped += 1
            return
        if record.seq != state.seq + 1:
            log.warning(
                "restore: instance %s jumps from seq %d to %d; history is incomplete",
                record.instance_id,
                state.seq,
                record.seq,
            )
        records = self._history.setdefault(instance_id, {})
        if isinstance(record, WorkflowReset):
            # The state after a reset is the fold of the whole history (engine.replay.reset).
            self._states[instance_id] = state = reset_state(
                state, [*self._stored_history(instance_id, records), record]
            )
            records[record.seq] = value
            self.applied += 1
            return
        pruned = len(state.pruned_history)
        was_finished = state.status.finished
        state.apply(record)
        records[record.seq] = value
        if state.status.finished and not was_finished and unreleased(state):
            self._withdraw.add(instance_id)
        for low, high in state.pruned_history[pruned:]:  # pruned by a loop: not stored
            for seq in range(low, high):
                records.pop(seq, None)
        self.applied += 1

    def _stored_history(self, instance_id: str, folded: dict[int, bytes]) -> list[HistoryRecord]:
        """The instance's history so far: what the store holds and what was folded here."""
        reads = InstanceReads(self._store, self._serde)
        found = {r.seq: r for r in reads.read_history(instance_id)}
        for seq, value in folded.items():
            record = self._serde.decode(value)
            assert isinstance(record, HistoryRecord)
            found[seq] = record
        return [found[seq] for seq in sorted(found)]

    def _forget(self, instance_id: str) -> None:
        """Drop the instance: what was folded of it here, and its stored keys."""
        self._states.pop(instance_id, None)
        self._history.pop(instance_id, None)
        self._withdraw.discard(instance_id)
        if instance_id not in self._forgotten:
            forget_instance(self._store, instance_id, self._deletes)
            self._forgotten.add(instance_id)

    def batch(self) -> CommitBatch:
        """The state changes so far, as one batch; resets the pending changes."""
        batch, self._deletes = self._deletes, CommitBatch()
        self._forgotten.clear()
        for instance_id, records in self._history.items():
            for seq, value in records.items():
                batch.put(keys.history(instance_id, seq), value)
        for state in self._states.values():
            write_state(state, batch)
        for instance_id in self._withdraw:
            batch.put(keys.withdraw(instance_id), b"")
        self._withdraw.clear()
        self._history.clear()
        self._states.clear()
        return batch
