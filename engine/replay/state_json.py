"""The stored form of instance state: the JSON values of its meta, of each entry, of each
buffered event and of a payload kept on its own, and the state read back from them.

State is stored as one small meta value plus one value per entry (replay key), so a step
rewrites O(1) bytes however long the workflow is; the input and buffered events have keys
of their own for the same reason. The keys are ``consumers.state_keys``'s.
"""

from __future__ import annotations

import base64
import binascii
from enum import StrEnum
from typing import Any, TypeVar, cast

import orjson

from stepstream.engine.replay.state import (
    BufferedEvent,
    Entry,
    EntryKind,
    EntryState,
    InstanceState,
    Status,
)
from stepstream.engine.wire.records import Payload

_E = TypeVar("_E", bound=StrEnum)
_MEMBERS: dict[type[StrEnum], dict[str, StrEnum]] = {
    enum: {member.value: member for member in enum} for enum in (Status, EntryKind, EntryState)
}


def _member(enum: type[_E], value: str) -> _E:
    """``enum(value)`` by a dict look-up (an enum's own look-up by value is about 20
    times slower); an unknown value raises the enum's own ValueError."""
    member = _MEMBERS[enum].get(value)
    return cast(_E, member) if member is not None else enum(value)


def entry_json(entry: Entry) -> bytes:
    """An entry as stored under its own key: the fields that are set, in pairs."""
    # The enums as they are: orjson writes a StrEnum member as its value.
    out: dict[str, Any] = {"k": entry.kind, "s": entry.state, "q": entry.seq}
    if entry.attempt:
        out["a"] = entry.attempt
    if entry.max_attempts or entry.names is not None:
        out["m"] = entry.max_attempts  # a step's limit, a loop's pruning, a message wait's max
    if entry.result is not None:
        out["r"] = _payload_json(entry.result)
    if entry.error_type:
        out["et"] = entry.error_type
        out["em"] = entry.error_message
    if entry.timer_id is not None:
        out["t"] = entry.timer_id
        out["f"] = entry.fire_at_ms
    if entry.event_name is not None:
        out["e"] = entry.event_name
    if entry.winner is not None:
        out["w"] = entry.winner
        out["l"] = entry.losers
    if entry.marks is not None:
        out["mk"] = [[i, q] for i, q in entry.marks.items()]
    if entry.child_id is not None:
        out["ch"] = entry.child_id
    if entry.names is not None:
        out["nm"] = entry.names
    if entry.messages is not None:
        out["ms"] = [[i, n, _payload_json(p), t] for i, n, p, t in entry.messages]
    return orjson.dumps(out)


def entry_from_json(key: str, raw: dict[str, Any]) -> Entry:
    """The entry of replay key ``key`` from its stored value, parsed."""
    # The mirror of ``entry_json``, which writes fields in pairs and only when set: an
    # instance reloaded after eviction reads every entry it has, so this is quick
    # for the usual entry (kind, state and seq, and a field or two).
    entry = Entry(key, _member(EntryKind, raw["k"]), _member(EntryState, raw["s"]), raw["q"])
    if "a" in raw:
        entry.attempt = raw["a"]
    if "m" in raw:
        entry.max_attempts = raw["m"]
    if "r" in raw:
        entry.result = _payload_from(raw["r"])
    if "et" in raw:
        entry.error_type = raw["et"]
        entry.error_message = raw.get("em", "")
    if "t" in raw:
        entry.timer_id = raw["t"]
        entry.fire_at_ms = raw.get("f")
    if len(raw) > 3:  # more than kind, state and seq: the rarer fields
        entry.event_name = raw.get("e")
        entry.winner = raw.get("w")
        entry.losers = raw.get("l")
        if "mk" in raw:
            entry.marks = {i: q for i, q in raw["mk"]}
        entry.child_id = raw.get("ch")
        entry.names = raw.get("nm")
        if entry.names is not None and "m" not in raw:
            # Stored without its max by an earlier version: one at a time loses nothing.
            entry.max_attempts = 1
        if "ms" in raw:
            entry.messages = [(i, n, _payload_req(p), t) for i, n, p, t in raw["ms"]]
    return entry


def meta_json(state: InstanceState) -> bytes:
    """The instance's meta value: everything but its entries, input and buffered events,
    which have keys of their own."""
    raw: dict[str, Any] = {
        "w": state.workflow,
        "v": state.version,
        "st": state.status,
        "c": state.created_ms,
        "u": state.updated_ms,
        "q": state.seq,
        "r": _payload_json(state.result),
        "et": state.error_type,
        "em": state.error_message,
        "cr": state.cancel_reason,
        "fm": state.finished_ms,
        "pk": state.parked,
        "pi": [state.parent_id, state.parent_key] if state.parent_id else None,
        "tp": [state.traceparent, state.tracestate] if state.traceparent else None,
        "bn": len(state.buffered) + state.unread_buffered,
        "rc": list(state.recent_commands),
    }
    # Written only when they say something (read back with their defaults): the meta
    # is written at every transition.
    if state.run != 1:
        raw["rn"] = state.run
    if state.paused_pending:
        raw["pp"] = 1
    priority, queue_key = state.queue_request
    if priority or queue_key is not None:
        raw["qr"] = [priority, queue_key]
    if state.forked_from:
        raw["fk"] = [state.forked_from, state.forked_at]
    if state.attempt_floors:
        raw["af"] = state.attempt_floors
    if state.requeued:
        raw["rq"] = state.requeued
    if state.attributes:
        raw["at"] = state.attributes
    return orjson.dumps(raw)


def state_from_storage(
    instance_id: str,
    meta: bytes,
    entries: list[tuple[str, bytes]],
    input: bytes | None = None,
    buffered: list[bytes] | None = None,
) -> InstanceState:
    """The instance's state from its meta and its entries' (key, value) pairs.

    ``input``: the value of the instance's input key; ``buffered``: the values of
    its buffered events' keys, in order (None: not read). A meta written before they
    had keys of their own holds them."""
    raw = orjson.loads(meta)
    inline = raw.get("i")
    inline_buffered = raw.get("b")
    rows = (
        inline_buffered
        if inline_buffered is not None
        else [orjson.loads(value) for value in buffered or ()]
    )
    status = _member(Status, raw["st"])
    state = InstanceState(
        instance_id=instance_id,
        workflow=raw["w"],
        version=raw["v"],
        status=status,
        created_ms=raw["c"],
        updated_ms=raw["u"],
        seq=raw["q"],
        input=_payload_from(inline) if input is None else payload_from_bytes(input),
        result=_payload_from(raw["r"]),
        error_type=raw["et"],
        error_message=raw["em"],
        cancel_reason=raw["cr"],
        # State written before finish times were kept: the last update is the finish.
        finished_ms=raw.get("fm") or (raw["u"] if status.finished else 0),
        parked=raw.get("pk", ""),
        run=raw.get("rn", 1),
        parent_id=(raw.get("pi") or ["", ""])[0],
        parent_key=(raw.get("pi") or ["", ""])[1],
        traceparent=(raw.get("tp") or [None, None])[0],
        tracestate=(raw.get("tp") or [None, None])[1],
        queue_request=(raw["qr"][0], raw["qr"][1]) if raw.get("qr") else (0, None),
        buffered=[
            BufferedEvent(b[0], _payload_req(b[1]), b[2], b[3], b[4] if len(b) > 4 else 0)
            for b in rows
        ],
    )
    state.indexed_created_ms = state.created_ms
    state.paused_pending = bool(raw.get("pp"))
    state.recent_commands.extend(raw["rc"])
    if "fk" in raw:
        state.forked_from, state.forked_at = raw["fk"]
    if "af" in raw:
        state.attempt_floors = dict(raw["af"])
    if "rq" in raw:
        state.requeued = dict(raw["rq"])
    if "at" in raw:
        state.attributes = raw["at"]
    # What an older meta held inline moves to keys of its own at the next write.
    state.new_input = inline is not None
    if inline_buffered is not None:
        state.new_buffered = list(state.buffered)
    elif buffered is None:
        state.unread_buffered = raw.get("bn", 0)
    for key, value in entries:
        entry = state.entries[key] = entry_from_json(key, orjson.loads(value))
        if entry.state is EntryState.WAITING:
            state.open_wait(entry)
    return state


def _payload_json(payload: Payload | None) -> list[str] | None:
    if payload is None:
        return None
    return [payload.content_type, base64.b64encode(payload.data).decode()]


def _payload_from(raw: list[str] | None) -> Payload | None:
    return None if raw is None else _payload_req(raw)


def _payload_req(raw: list[str]) -> Payload:
    # binascii directly: base64.b64decode checks and converts its argument first, which
    # made it 2.4 times slower for the same answer.
    return Payload(raw[0], binascii.a2b_base64(raw[1]))


def buffered_json(event: BufferedEvent) -> bytes:
    """A buffered event as stored under its own key."""
    return orjson.dumps(
        [event.name, _payload_json(event.payload), event.command_id, event.seq, event.time_ms]
    )


def payload_bytes(payload: Payload) -> bytes:
    """A payload as stored on its own (an answer to a message)."""
    return orjson.dumps(_payload_json(payload))


def payload_from_bytes(raw: bytes) -> Payload:
    return _payload_req(orjson.loads(raw))
