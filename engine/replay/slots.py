"""Which queue slots an instance holds, and which it must ask for again.

A slot is asked for with a ``queue.acquire`` message recorded under ``<slot>#acquire``,
admitted into the wait ``<slot>`` and given back with ``<slot>#release`` (or withdrawn
when the instance finishes holding it: ``engine.replay.admission``). A reset, retry or
fork can keep the admission while the slot is no longer this run's:

- a reset sets aside the release (or the finish that withdrew the slot): the queue
  already gave the slot to someone else;
- a fork copies its source's admission: the slot is the source's.

Replaying that admission would let the run go on beside the holders the limit allows.
Such a slot is *given back*: its entries leave the state (its records stay in the
history) and the code asks the queue again under a new key, ``<slot>#ask<n>``
(``engine.api.queues.ask_key``), a new request with a command id of its own (the queue
applies the first one's id once, and would drop a repeat). Which slots were given back
follows from the history alone, so the hot path and a restore reach the same state."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from stepstream.engine.api.queues import QUEUE_ACQUIRE, QUEUE_RELEASE, asked_slot
from stepstream.engine.replay.entries import Entry, EntryKind
from stepstream.engine.wire.records import (
    HistoryRecord,
    MessageSent,
    WorkflowCancelledRecord,
    WorkflowCompleted,
    WorkflowFailedRecord,
    WorkflowForked,
    WorkflowRestarted,
    WorkflowTerminatedRecord,
)

if TYPE_CHECKING:
    from stepstream.engine.replay.state import InstanceState

_ACQUIRE = "#acquire"
_RELEASE = "#release"
_FINISHES = (
    WorkflowCompleted,
    WorkflowFailedRecord,
    WorkflowCancelledRecord,
    WorkflowTerminatedRecord,
)


def unreleased(state: InstanceState) -> list[tuple[str, Entry]]:
    """(slot key, request) of each slot the instance asked a queue for and never gave
    back (held, or still waited for)."""
    entries = state.entries
    found = []
    for entry in entries.values():
        if (
            entry.kind is EntryKind.SENT
            and entry.event_name == QUEUE_ACQUIRE
            and entry.key.endswith(_ACQUIRE)
        ):
            slot = entry.key[: -len(_ACQUIRE)]
            if f"{slot}{_RELEASE}" not in entries:
                found.append((slot, entry))
    return found


def give_back(state: InstanceState, slots: Iterable[str]) -> None:
    """Note ``slots`` as given back: the code asks for each again under its next key,
    and an admission the state still holds for one is dropped."""
    entries = state.entries
    gone: list[Entry] = []
    for slot in slots:
        base, number = asked_slot(slot)
        state.requeued[base] = max(state.requeued.get(base, 0), number)
        if f"{slot}{_RELEASE}" in entries:
            continue  # given back before the point the run goes on from: replayed
        gone += [entries[key] for key in (f"{slot}{_ACQUIRE}", slot) if key in entries]
    state.drop(gone)


class GivenBack:
    """Follows a history in seq order, told for each record whether a reset set it
    aside, and gathers the slots of the current run that were given back (``slots``)."""

    def __init__(self) -> None:
        self.slots: set[str] = set()
        self._asked: set[str] = set()
        self._released: set[str] = set()  # by records that still count

    def see(self, record: HistoryRecord, aside: bool) -> None:
        if isinstance(record, MessageSent):
            if record.name == QUEUE_ACQUIRE and record.key.endswith(_ACQUIRE):
                self._asked.add(record.key[: -len(_ACQUIRE)])
            elif record.name == QUEUE_RELEASE and record.key.endswith(_RELEASE):
                slot = record.key[: -len(_RELEASE)]
                (self.slots if aside else self._released).add(slot)
        elif (aside and isinstance(record, _FINISHES)) or isinstance(record, WorkflowForked):
            # A finish withdrew every slot still held; a fork's copied ones are its
            # source's, even where a later reset of the fork set the fork point aside.
            self.slots |= self._asked - self._released
        elif isinstance(record, WorkflowRestarted) and not aside:
            self.slots.clear()  # a new run asks under keys of its own
            self._asked.clear()
            self._released.clear()


def given_back(records: Iterable[HistoryRecord], aside: set[int]) -> set[str]:
    """The slots of the current run that ``records`` (the whole history, in seq order)
    gave back, ``aside`` being the seqs its resets set aside."""
    seen = GivenBack()
    for record in records:
        seen.see(record, record.seq in aside)
    return seen.slots
