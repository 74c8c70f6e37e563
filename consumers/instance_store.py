"""An instance's committed state in a partition's store: how it is read, written and
forgotten. The processor, restore and snapshots all go through these functions, so one
instance's keys have one layout (``consumers.state_keys``) and one reader."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import orjson

from stepstream.consumers import state_keys as keys
from stepstream.consumers.created_listing import page_by_created
from stepstream.consumers.meta_filter import marks as meta_marks
from stepstream.consumers.meta_filter import status_in
from stepstream.engine.reads.listing import RECENT_FAILURES, InstancePage, ListQuery, Overview
from stepstream.engine.reads.views import InstanceStatus
from stepstream.engine.replay.ids import is_client_command
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.replay.state_json import (
    buffered_json,
    entry_json,
    meta_json,
    payload_bytes,
    payload_from_bytes,
    state_from_storage,
)
from stepstream.engine.replay.status import Status
from stepstream.engine.seams import CommitBatch, StateStore
from stepstream.engine.wire.records import CommandIgnored, HistoryRecord, Payload, Record
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.settle import recorded_reason


def load_state(
    store: StateStore, instance_id: str, *, entries: bool = True
) -> InstanceState | None:
    """An instance's committed state; without ``entries`` only its meta (status, result,
    error, timestamps; no entries, and no input unless the meta holds it), which is all a
    status or result check needs."""
    meta = store.get(keys.meta(instance_id))
    if meta is None:
        return None
    if not entries:
        return state_from_storage(instance_id, meta, [])
    prefix = keys.entry_prefix(instance_id)
    found = [(k[len(prefix) :].decode(), v) for k, v in store.scan(prefix)]
    buffered = [v for _, v in store.scan(keys.buffered_prefix(instance_id))]
    return state_from_storage(
        instance_id, meta, found, store.get(keys.input_key(instance_id)), buffered
    )


def load_states(store: StateStore, instance_ids: Sequence[str]) -> dict[str, InstanceState | None]:
    """The committed state (with entries) of each of ``instance_ids`` as ``load_state``
    reads it (None: no such instance), but read together: their metas in one multi-get,
    then the inputs of those that exist in another and their entries and buffered events
    in one ordered pass, instead of four reads each. One whose stored state does not
    decode is left out: its own ``load_state`` meets the error where it did before, and
    only if it is loaded."""
    ids = list(dict.fromkeys(instance_ids))
    metas = store.get_many([keys.meta(i) for i in ids])
    states: dict[str, InstanceState | None] = {
        i: None for i, meta in zip(ids, metas, strict=True) if meta is None
    }
    present = [n for n, meta in enumerate(metas) if meta is not None]
    if not present:
        return states  # starts of new instances: one read each, as before
    inputs = store.get_many([keys.input_key(ids[n]) for n in present])
    entry_prefixes = [keys.entry_prefix(ids[n]) for n in present]
    scanned = store.scan_many(entry_prefixes + [keys.buffered_prefix(ids[n]) for n in present])
    for at, n in enumerate(present):
        instance_id, meta = ids[n], metas[n]
        assert meta is not None
        cut = len(entry_prefixes[at])
        try:
            entries = [(k[cut:].decode(), v) for k, v in scanned[at]]
            buffered = [v for _, v in scanned[len(present) + at]]
            states[instance_id] = state_from_storage(
                instance_id, meta, entries, inputs[at], buffered
            )
        except Exception:
            continue
    return states


def write_state(state: InstanceState, batch: CommitBatch) -> None:
    """Queue the changed parts of an instance's state: its input once, buffered events
    as they come and go, the meta, dirty entries, the active, finished and started
    indexes."""
    # Every transition passes here: the rarely used parts are looked at only when set.
    instance_id = state.instance_id
    if state.created_ms != state.indexed_created_ms:  # a new instance, or a new run
        if state.indexed_created_ms >= 0:
            batch.delete(keys.started(state.indexed_created_ms, instance_id))
        batch.put(keys.started(state.created_ms, instance_id), b"")
        # As for the active index: a commit that fails drops every state in memory.
        state.indexed_created_ms = state.created_ms
    if state.new_input and state.input is not None:
        batch.put(keys.input_key(instance_id), payload_bytes(state.input))
        state.new_input = False
    if state.new_buffered:
        for event in state.new_buffered:
            batch.put(keys.buffered(instance_id, event.seq), buffered_json(event))
        state.new_buffered.clear()
    if state.taken_buffered:  # after the puts: one taken in the same batch goes
        for seq in state.taken_buffered:
            batch.delete(keys.buffered(instance_id, seq))
        state.taken_buffered.clear()
    batch.put(keys.meta(instance_id), meta_json(state))
    dirty = state.dirty_entries
    if dirty:
        entries = state.entries
        for key in dirty:
            batch.put(keys.entry(instance_id, key), entry_json(entries[key]))
        dirty.clear()
    if state.deleted_entries:  # pruned by a loop, or set aside by a reset
        for key in state.deleted_entries:
            batch.delete(keys.entry(instance_id, key))
        state.deleted_entries.clear()
    if state.pruned_history:
        for low, high in state.pruned_history:
            for seq in range(low, high):
                batch.delete(keys.history(instance_id, seq))
        state.pruned_history.clear()
    if state.new_commands:
        for command_id in state.new_commands:
            batch.put(keys.command(instance_id, command_id), b"")
        state.new_commands.clear()
    if state.new_replies:
        for message_id, answer in state.new_replies.items():
            batch.put(keys.reply(instance_id, message_id), payload_bytes(answer))
        state.new_replies.clear()
    if state.unfinished_ms:  # a reset took the finish back
        batch.delete(keys.finished(state.unfinished_ms, instance_id))
        state.unfinished_ms = 0
    if state.status.finished:
        batch.delete(keys.active(instance_id))
        batch.put(keys.finished(state.finished_ms, instance_id), b"")
        state.active_stored = False
    elif not state.active_stored:
        # Once per state object, not at every transition. A commit that fails drops
        # every state in memory (the processor reloads), so none is left believing it.
        batch.put(keys.active(instance_id), b"")
        state.active_stored = True


def forget_instance(
    store: StateStore, instance_id: str, batch: CommitBatch, state: InstanceState | None = None
) -> None:
    """Queue the deletion of every key an instance has in ``store`` (``state``: its meta,
    if the caller has already read it)."""
    if state is None:
        state = load_state(store, instance_id, entries=False)
    if state is not None:
        # The stored key, and one a write queued in the same batch may have put.
        for created_ms in {state.created_ms, state.indexed_created_ms} - {-1}:
            batch.delete(keys.started(created_ms, instance_id))
        if state.status.finished:
            batch.delete(keys.finished(state.finished_ms, instance_id))
    for prefix in keys.instance_prefixes(instance_id):
        for key, _ in store.scan(prefix):
            batch.delete(key)
    batch.delete(keys.meta(instance_id))
    batch.delete(keys.active(instance_id))


class StoredHistory:
    """``engine.replay.reset.HistoryAccess`` over a partition's store: what a reset or a
    fork reads of an instance's history, and how records travel as bytes."""

    def __init__(self, store: StateStore, serde: RecordSerde) -> None:
        self._reads = InstanceReads(store, serde)
        self._serde = serde

    def stored(self, instance_id: str) -> list[HistoryRecord]:
        return self._reads.read_history(instance_id)

    def encode(self, record: Record) -> bytes:
        return self._serde.encode(record)

    def decode(self, value: bytes) -> Record:
        return self._serde.decode(value)


class InstanceReads:
    """The reads a partition's owner answers from its committed state: point reads and
    one instance's prefix, never a scan of the partition (except ``list_instances`` and
    ``overview_slice``, which like ``list_page`` looks at a bounded number of keys)."""

    def __init__(self, store: StateStore, serde: RecordSerde) -> None:
        self._store = store
        self._serde = serde

    def finished(self, instance_id: str) -> bool | None:
        """None if no such instance, else whether it finished: two point reads, no
        decoding, for checks on the hot path of every command."""
        if self._store.get(keys.meta(instance_id)) is None:
            return None
        return self._store.get(keys.active(instance_id)) is None

    def applied(self, state: InstanceState, command_id: str) -> bool:
        """Whether the client command ``command_id`` was applied to the instance: in
        memory for the recent ones, else one point read of the committed state."""
        if command_id in state.recent_commands or command_id in state.new_commands:
            return True
        # Only client commands are kept one key each (timer fires and step outcomes are
        # told apart by the state they find).
        return (
            is_client_command(command_id)
            and self._store.get(keys.command(state.instance_id, command_id)) is not None
        )

    def settled_before(self, instance_id: str, command_id: str) -> tuple[bool, str | None]:
        """Whether the instance's committed state shows ``command_id`` applied (maybe by
        an earlier owner), and what its publisher is told about it."""
        state = load_state(self._store, instance_id, entries=False)
        if state is None or not self.applied(state, command_id):
            return False, None
        for record in reversed(self.read_history(instance_id)):
            if record.command_id == command_id and isinstance(record, CommandIgnored):
                return True, recorded_reason(record.command_type, record.reason)
        return True, None

    def reply(self, instance_id: str, message_id: str) -> Payload | None:
        """The instance's answer to the message ``message_id``, if it gave one."""
        raw = self._store.get(keys.reply(instance_id, message_id))
        return None if raw is None else payload_from_bytes(raw)

    def read_state(self, instance_id: str, *, entries: bool = True) -> InstanceState | None:
        return load_state(self._store, instance_id, entries=entries)

    def read_history(self, instance_id: str) -> list[HistoryRecord]:
        records = []
        for _, value in self._store.scan(keys.history_prefix(instance_id)):
            record = self._serde.decode(value)
            assert isinstance(record, HistoryRecord)
            records.append(record)
        return records

    def list_instances(self) -> list[InstanceState]:
        """Every instance of the partition; unfinished ones with their entries, so a
        listing shows what each waits on (a finished instance waits for nothing)."""
        found = []
        for key, _ in self._store.scan(keys.ACTIVE):
            state = load_state(self._store, keys.split_active(key))
            if state is not None:
                found.append(state)
        for key, meta in self._store.scan(keys.META):
            instance_id = keys.split_meta(key)
            state = state_from_storage(instance_id, meta, [])
            if state.status.finished:
                found.append(state)
        return found

    def list_page(self, query: ListQuery, budget: int) -> InstancePage:
        """The instances of ``query`` on this partition, in id order, looking at no more
        than ``budget`` instances: a page cut short by the budget has the last id looked
        at as its cursor. Only metas are read, and a filter is checked on the raw bytes
        before any is decoded, so a rare status, workflow or attribute costs one key read
        each."""
        scope = keys.META + keys.escape_id(query.prefix)
        start = scope
        if query.after is not None:
            # Escaped ids hold no 0x00: this is the first key after the cursor's.
            start = max(start, keys.meta(query.after) + b"\x00")
        marks = meta_marks(query)
        found: list[InstanceStatus] = []
        looked = 0
        for key, meta in self._store.scan(scope, start):
            looked += 1
            if all(mark in meta for mark in marks) and (
                # Attributes by parsing the meta, not decoding it into a state: a number
                # has no mark of its value.
                not query.where or query.has_attributes(orjson.loads(meta).get("at", {}))
            ):
                view = InstanceStatus.of(state_from_storage(keys.split_meta(key), meta, []))
                if query.matches(view):
                    found.append(view)
                    if len(found) >= query.limit:
                        return InstancePage(found, view.instance_id)
            if looked >= budget:
                return InstancePage(found, keys.split_meta(key))
        return InstancePage(found, None)

    def list_by_created(self, query: ListQuery) -> InstancePage:
        """The instances of ``query`` on this partition newest (or oldest) first by
        created time, from its cursor on (``consumers.created_listing``)."""
        return page_by_created(self._store, query)

    def overview_slice(
        self, since_ms: int, start: bytes | None, budget: int
    ) -> tuple[Overview, bytes | None]:
        """Part of the overview, from at most ``budget`` keys on from ``start`` (None: the
        beginning), and the key to go on from (None: done). First every instance by
        status, read off its meta without decoding it; then those that finished since
        ``since_ms`` (the finished index from there), by status, with the latest
        failures."""
        counts: dict[str, int] = {}
        finished: dict[str, int] = {}
        failures: deque[InstanceStatus] = deque(maxlen=RECENT_FAILURES)
        looked = 0

        def partial() -> Overview:
            # The index runs oldest first.
            return Overview(counts, finished, list(reversed(failures)))

        resume = start
        if resume is None or resume.startswith(keys.META):
            for key, meta in self._store.scan(keys.META, resume):
                if looked >= budget:
                    return partial(), key
                looked += 1
                status = status_in(meta)
                counts[status] = counts.get(status, 0) + 1
            resume = keys.finished(since_ms, "")
        for key, _ in self._store.scan(keys.FINISHED, resume):
            if looked >= budget:
                return partial(), key
            looked += 1
            _, instance_id = keys.split_finished(key)
            raw = self._store.get(keys.meta(instance_id))
            if raw is None:
                continue
            status = status_in(raw)
            if not Status(status).finished:
                continue  # a key an older release left when it reset the instance
            finished[status] = finished.get(status, 0) + 1
            if status == "failed":
                state = state_from_storage(instance_id, raw, [])
                failures.append(InstanceStatus.of(state))
        return partial(), None
