"""Read models handed to users: an instance's status and its history, as plain values
that serialise to JSON for the CLI and the HTTP API."""

from __future__ import annotations

import base64
import dataclasses
from collections import Counter
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

from stepstream.engine.api.queues import QUEUE_ADMITTED
from stepstream.engine.errors import StepstreamError
from stepstream.engine.replay.state import Entry, EntryState, InstanceState
from stepstream.engine.wire.codec import PayloadCodec, decode_safely
from stepstream.engine.wire.records import HistoryRecord, MessagesReceived, Payload


def _known(cls: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """Fields this version knows: a newer server may send more."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in raw.items() if k in names}


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def created_iso(ms: int) -> str:
    """A created time in ms as ``InstanceStatus.created_at`` writes it (lists compare
    and sort these strings)."""
    return _iso(ms)


@dataclass(frozen=True, slots=True)
class Wait:
    """Something an unfinished instance is waiting on."""

    key: str
    kind: str
    state: str
    attempt: int = 0
    until: str | None = None
    event: str | None = None
    # A wait for a queue's admission (kind "queue"): the queue's instance id, and where
    # the request stands (1: admitted next) among ``waiting`` waiters, read from the
    # queue's state (``producers.queue_positions``); unset until the queue has taken it.
    queue: str | None = None
    position: int | None = None
    waiting: int | None = None


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    instance_id: str
    status: str
    workflow: str
    version: str
    created_at: str
    updated_at: str
    waits: list[Wait] = field(default_factory=list)
    buffered_events: int = 0
    error: str | None = None
    # A fork's origin: "forked from o-1 at charge#2" (None for other instances).
    origin: str | None = None
    # The run number: 1, one more each time ``if_exists="restart_if_failed"`` restarted it.
    run: int = 1
    # Search attributes the workflow set (``ctx.set_attributes``).
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed", "cancelled", "terminated")

    @property
    def diverged(self) -> bool:
        """Parked: the deployed code cannot run it (``error`` says why: its history no
        longer matches the code, its version is not deployed, or the payload codec
        cannot read it); it goes on once code that can is deployed."""
        return not self.finished and bool(self.error)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["waits"] = [{f.name: getattr(w, f.name) for f in fields(w)} for w in self.waits]
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> InstanceStatus:
        waits = [Wait(**_known(Wait, w)) for w in raw.get("waits", [])]
        return cls(**{**_known(cls, raw), "waits": waits})

    @classmethod
    def of(cls, state: InstanceState) -> InstanceStatus:
        waits = []
        if not state.status.finished:  # a cancelled instance waits for nothing
            entries = sorted(state.open_entries(), key=lambda e: e.seq)
            come = _come(state, entries)
            waits = [_wait(state, e, e.key in come) for e in entries]
        error = None
        if state.error_type:
            error = f"{state.error_type}: {state.error_message}"
        elif state.cancel_reason:
            error = f"{state.status.value}: {state.cancel_reason}"
        elif state.parked and not state.status.finished:
            error = state.parked
        return cls(
            instance_id=state.instance_id,
            status=state.status.value,
            workflow=state.workflow,
            version=state.version,
            created_at=_iso(state.created_ms),
            updated_at=_iso(state.updated_ms),
            waits=waits,
            buffered_events=len(state.buffered) + state.unread_buffered,
            error=error,
            origin=(
                f"forked from {state.forked_from} at {state.forked_at}"
                if state.forked_from
                else None
            ),
            run=state.run,
            attributes=dict(state.attributes),
        )


def _come(state: InstanceState, entries: list[Entry]) -> set[str]:
    """The waits (keys) whose event has come and waits in the buffer for the code to take
    it, as a paused instance's do: each buffered event goes to the oldest wait for its
    name, once. Not a wait with a timeout: that may pass before the instance resumes."""
    if not state.buffered:
        return set()
    unclaimed = Counter(event.name for event in state.buffered)
    come = set()
    for entry in entries:
        if entry.state is not EntryState.WAITING or entry.fire_at_ms is not None:
            continue
        for name in entry.waited_names:
            if unclaimed[name]:
                unclaimed[name] -= 1
                come.add(entry.key)
                break
    return come


def _wait(state: InstanceState, entry: Entry, come: bool) -> Wait:
    """``come``: what it waits for is in the buffer (see ``_come``); a queue's admission
    means the instance holds its slot now."""
    queue = None
    if entry.names and entry.names[0].startswith(QUEUE_ADMITTED):
        request = state.entries.get(f"{entry.key}#acquire")
        queue = request.child_id if request is not None else None
    wait_state = entry.state.value
    if come:
        wait_state = "admitted" if queue else "received"
    return Wait(
        key=entry.key,
        kind="queue" if queue else entry.kind.value,
        state=wait_state,
        attempt=entry.attempt,
        until=None if entry.fire_at_ms is None else _iso(entry.fire_at_ms),
        event=entry.event_name,
        queue=queue,
    )


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    seq: int
    type: str
    time: str
    command_id: str
    attributes: dict[str, Any]
    # Set aside by a later reset: kept, no longer replayed (``WorkflowReset``).
    set_aside: bool = False
    # Where ``attributes`` shows a payload as stored, ``{content_type, base64}``, as the
    # codec that read it could not decode it: the attribute's name (``payloads.<i>`` for
    # a message's). Said apart, so a decoded value of that same shape is not taken for one.
    undecoded: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> HistoryEntry:
        return cls(**_known(cls, raw))

    @classmethod
    def of(cls, record: HistoryRecord, codec: PayloadCodec) -> HistoryEntry:
        attributes: dict[str, Any] = {}
        undecoded: list[str] = []
        for f in fields(record):
            value = getattr(record, f.name)
            if f.name in _ENVELOPE or (value is None and f.name in SHOWN_WHEN_SET):
                continue
            attributes[f.name] = _plain(value, codec, f.name, undecoded)
        if isinstance(record, MessagesReceived):  # payloads as one decoded list
            del attributes["content_types"], attributes["data"]
            attributes["payloads"] = _plain(record.payloads, codec, "payloads", undecoded)
        return cls(
            record.seq,
            record.type,
            _iso(record.time_ms),
            record.command_id,
            attributes,
            undecoded=undecoded,
        )

    def shown_as_stored(self, where: str) -> Payload | None:
        """The payload at ``where`` (an attribute, or ``payloads.<i>``) if the codec that
        read it could not decode it, as it is stored; None if it was decoded."""
        if where not in self.undecoded:
            return None
        name, _, index = where.partition(".")
        value = self.attributes.get(name)
        if index and isinstance(value, list) and index.isdigit() and int(index) < len(value):
            value = value[int(index)]
        if not isinstance(value, dict):
            return None
        try:
            data = base64.b64decode(str(value.get("base64", "")), validate=True)
        except ValueError:  # binascii.Error: not what this view writes
            return None
        return Payload(str(value.get("content_type", "")), data)


# Fields of a later schema version a record of an earlier one lacks: shown when set, so
# the histories of workflows that do not use them read as before.
SHOWN_WHEN_SET = frozenset({"priority", "queue_key"})


def mark_set_aside(entries: list[HistoryEntry]) -> list[HistoryEntry]:
    """``entries`` with those a ``WorkflowReset`` among them set aside marked so."""
    aside: set[int] = set()
    for entry in entries:
        if entry.type == "WorkflowReset":
            aside.update(range(int(entry.attributes["from_seq"]), entry.seq))
    return [
        dataclasses.replace(entry, set_aside=True) if entry.seq in aside else entry
        for entry in entries
    ]


_ENVELOPE = frozenset(
    {"instance_id", "seq", "time_ms", "command_id", "epoch", "traceparent", "tracestate"}
)


def _plain(value: Any, codec: PayloadCodec, where: str, undecoded: list[str]) -> Any:
    if isinstance(value, Payload):
        # Decoded by the configured codec (the hook may seal JSON under its own content
        # type); what it cannot read is shown as it is stored, and said to be.
        try:
            return decode_safely(codec, value)
        except StepstreamError:
            undecoded.append(where)
            return {
                "content_type": value.content_type,
                "base64": base64.b64encode(value.data).decode(),
            }
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, list):
        return [_plain(item, codec, f"{where}.{i}", undecoded) for i, item in enumerate(value)]
    return value
