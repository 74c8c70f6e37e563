"""Instance state: the fold of an instance's history records, and how it is stored.

``InstanceState.apply`` is the only way state changes, both on the hot path (records the
runtime just decided) and on restore (records read back from the history topic), so a
restored instance is exactly the instance that was lost. State is stored as one small
meta value plus one value per entry (replay key), so a step rewrites O(1) bytes however
long the workflow is.
"""

from __future__ import annotations

import base64
import binascii
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar, cast

import orjson

from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.records import (
    ChildStarted,
    EventBuffered,
    HistoryRecord,
    LoopAdvanced,
    MessageCompleted,
    MessageSent,
    MessagesReceived,
    MessageWaitStarted,
    Payload,
    RaceDecided,
    SleepElapsed,
    SleepStarted,
    StepAttemptStarted,
    StepFailed,
    StepSucceeded,
    ValueRecorded,
    WaitSatisfied,
    WaitStarted,
    WaitTimedOut,
    WorkflowCancelled,
    WorkflowCompleted,
    WorkflowFailed,
    WorkflowPaused,
    WorkflowResumed,
    WorkflowStarted,
)


class Status(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED})
_ALLOWED: dict[Status, frozenset[Status]] = {
    Status.PENDING: frozenset(
        {Status.RUNNING, Status.PAUSED, Status.COMPLETED, Status.FAILED, Status.CANCELLED}
    ),
    Status.RUNNING: frozenset({Status.PAUSED, Status.COMPLETED, Status.FAILED, Status.CANCELLED}),
    Status.PAUSED: frozenset({Status.RUNNING, Status.CANCELLED, Status.FAILED}),
    Status.COMPLETED: frozenset(),
    Status.FAILED: frozenset(),
    Status.CANCELLED: frozenset(),
}


class InvalidTransition(StepstreamError):
    """A record asked for a status change the state machine does not allow."""


class EntryKind(StrEnum):
    STEP = "step"
    SLEEP = "sleep"
    WAIT = "wait"
    VALUE = "value"
    RACE = "race"
    LOOP = "loop"
    CHILD = "child"
    SENT = "sent"  # a message sent to another instance


class EntryState(StrEnum):
    RUNNING = "running"  # step attempt in flight
    BACKOFF = "backoff"  # step waiting for its retry timer
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SLEEPING = "sleeping"
    ELAPSED = "elapsed"
    WAITING = "waiting"
    SATISFIED = "satisfied"
    TIMED_OUT = "timed_out"
    RECORDED = "recorded"
    ABANDONED = "abandoned"  # what a losing race branch was doing when the race ended

    @property
    def final(self) -> bool:
        return self not in _OPEN_ENTRY_STATES


_OPEN_ENTRY_STATES = frozenset(
    {EntryState.RUNNING, EntryState.BACKOFF, EntryState.SLEEPING, EntryState.WAITING}
)


def reply_key(message_id: str) -> str:
    """The replay key of the answer to a message (``msg.complete``)."""
    return f"~reply/{message_id}"


def message_command(sender_id: str, key: str) -> str:
    """The command id of a message one instance sends another: applied once however
    often it is published."""
    return f"msg:{len(sender_id)}:{sender_id}/{key}"


CHILD_COMMAND = "child:"


def child_command(parent_id: str, key: str) -> str:
    """The command id of a child's start: names its parent and its key there."""
    return f"{CHILD_COMMAND}{len(parent_id)}:{parent_id}/{key}"


def parse_child_command(command_id: str) -> tuple[str, str] | None:
    """(parent id, key) from a child's start command id, or None for other commands."""
    if not command_id.startswith(CHILD_COMMAND):
        return None
    size, sep, rest = command_id[len(CHILD_COMMAND) :].partition(":")
    if not sep or not size.isdigit() or rest[int(size) : int(size) + 1] != "/":
        return None
    return rest[: int(size)], rest[int(size) + 1 :]


def child_event(key: str) -> str:
    """The event a child sends its parent when it finishes (``~`` is not for clients)."""
    return f"~child/{key}"


def loop_prefixes(key: str, iteration: int) -> tuple[str, str]:
    """The key prefixes of one loop iteration: its scope, and the tasks it ran in (the
    keys of values read there start with the task's name)."""
    return f"{key}/{iteration}/", f"{key}/{iteration}."


def timer_id(instance_id: str, purpose: str, key: str, n: int) -> str:
    return f"{instance_id}/{purpose}/{n}/{key}"


def split_timer_id(instance_id: str, fired: str) -> tuple[str, str] | None:
    """(purpose, entry key) of one of the instance's timer ids; None for any other id.
    Instance ids and keys may hold "/": the instance id is known, the key is the rest."""
    prefix = f"{instance_id}/"
    if not fired.startswith(prefix):
        return None
    parts = fired[len(prefix) :].split("/", 2)
    return (parts[0], parts[2]) if len(parts) == 3 else None


_E = TypeVar("_E", bound=StrEnum)
_MEMBERS: dict[type[StrEnum], dict[str, StrEnum]] = {
    enum: {member.value: member for member in enum} for enum in (Status, EntryKind, EntryState)
}


def _member(enum: type[_E], value: str) -> _E:
    """``enum(value)`` by a dict look-up (an enum's own look-up by value is about 20
    times slower); an unknown value raises the enum's own ValueError."""
    member = _MEMBERS[enum].get(value)
    return cast(_E, member) if member is not None else enum(value)


@dataclass(slots=True)
class Entry:
    """What the history says about one replay key."""

    key: str
    kind: EntryKind
    state: EntryState
    seq: int
    attempt: int = 0
    max_attempts: int = 0
    result: Payload | None = None
    error_type: str = ""
    error_message: str = ""
    timer_id: str | None = None
    fire_at_ms: int | None = None
    event_name: str | None = None
    winner: str | None = None  # a race's winning branch
    losers: list[str] | None = None  # a race's losing branches, as scope prefixes
    # A loop's kept iterations: iteration -> seq of the LoopAdvanced that ended it.
    marks: dict[int, int] | None = None
    child_id: str | None = None  # a child workflow's instance id (its input in result)
    # A message wait: the names it takes (``max_attempts``: how many at most), and once
    # satisfied the messages it took: (id, name, payload, arrived at ms).
    names: list[str] | None = None
    messages: list[tuple[str, str, Payload, int]] | None = None

    def to_json(self) -> dict[str, Any]:
        # The enums as they are: orjson writes a StrEnum member as its value.
        out: dict[str, Any] = {"k": self.kind, "s": self.state, "q": self.seq}
        if self.attempt:
            out["a"] = self.attempt
            out["m"] = self.max_attempts
        if self.result is not None:
            out["r"] = _payload_json(self.result)
        if self.error_type:
            out["et"] = self.error_type
            out["em"] = self.error_message
        if self.timer_id is not None:
            out["t"] = self.timer_id
            out["f"] = self.fire_at_ms
        if self.event_name is not None:
            out["e"] = self.event_name
        if self.winner is not None:
            out["w"] = self.winner
            out["l"] = self.losers
        if self.marks is not None:
            out["mk"] = [[i, q] for i, q in self.marks.items()]
        if self.child_id is not None:
            out["ch"] = self.child_id
        if self.names is not None:
            out["nm"] = self.names
        if self.messages is not None:
            out["ms"] = [[i, n, _payload_json(p), t] for i, n, p, t in self.messages]
        return out

    @classmethod
    def from_json(cls, key: str, raw: dict[str, Any]) -> Entry:
        # The mirror of ``to_json``, which writes fields in pairs and only when set: an
        # instance reloaded after eviction reads every entry it has, so this is quick
        # for the usual entry (kind, state and seq, and a field or two).
        entry = cls(key, _member(EntryKind, raw["k"]), _member(EntryState, raw["s"]), raw["q"])
        if "a" in raw:
            entry.attempt = raw["a"]
            entry.max_attempts = raw.get("m", 0)
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
            if "ms" in raw:
                entry.messages = [(i, n, _payload_req(p), t) for i, n, p, t in raw["ms"]]
        return entry


@dataclass(slots=True)
class BufferedEvent:
    name: str
    payload: Payload
    command_id: str
    seq: int
    time_ms: int = 0  # when it reached the instance


RECENT_COMMANDS = 64
# Ids of commands the engine makes itself. Each is applied at most once by construction
# (a step outcome names its attempt, a timer fire its timer); every other command id is
# a client's, kept for good so that a re-delivered command is never applied twice.
INTERNAL_COMMAND_PREFIXES = ("step:", "recover:", "fire:", "fence:", "forget:", "snapshot:")


def is_client_command(command_id: str) -> bool:
    return bool(command_id) and not command_id.startswith(INTERNAL_COMMAND_PREFIXES)


@dataclass(slots=True)
class InstanceState:
    instance_id: str
    workflow: str = ""
    version: str = ""
    status: Status = Status.PENDING
    created_ms: int = 0
    updated_ms: int = 0
    seq: int = 0
    input: Payload | None = None
    result: Payload | None = None
    error_type: str = ""
    error_message: str = ""
    cancel_reason: str = ""
    finished_ms: int = 0  # when it completed, failed or was cancelled
    # Why an unfinished instance cannot advance where it is owned now (its version is
    # not deployed there); "" when it can. Set by the owner, not by history.
    parked: str = ""
    # The parent of a child workflow, and the child's key in it ("" for other instances).
    parent_id: str = ""
    parent_key: str = ""
    # The W3C trace context of the start: records caused by step outcomes and timer
    # fires (which carry none of their own) join the trace the client started.
    traceparent: str | None = None
    tracestate: str | None = None
    buffered: list[BufferedEvent] = field(default_factory=list)
    entries: dict[str, Entry] = field(default_factory=dict)
    recent_commands: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT_COMMANDS))
    dirty_entries: set[str] = field(default_factory=set)
    # Client command ids applied since the state was last written (stored one key each).
    new_commands: set[str] = field(default_factory=set)
    # Pruned by a loop since the state was last written: entries, and seq ranges
    # [from, to) of the instance's stored history records.
    deleted_entries: set[str] = field(default_factory=set)
    pruned_history: list[tuple[int, int]] = field(default_factory=list)
    # Answers to messages (msg.complete) since the state was last written: id -> answer.
    new_replies: dict[str, Payload] = field(default_factory=dict)
    # The input is stored once, under a key of its own, not in the meta each transition
    # rewrites: True until it has been (a start, or a meta of the layout that held it).
    new_input: bool = False
    # Buffered events have a key each (the meta would rewrite every payload at every
    # transition): those to store and the seqs of those taken since the last write.
    new_buffered: list[BufferedEvent] = field(default_factory=list)
    taken_buffered: list[int] = field(default_factory=list)
    # Buffered events the meta counts but were not read (a state read for its status).
    unread_buffered: int = 0
    # Entries that may be waiting, by the event or message name they wait for: a
    # superset (one that stopped waiting leaves when next looked at), so an event does
    # not look through every entry. Not stored: rebuilt from the entries when read.
    open_waits: dict[str, dict[str, Entry]] = field(default_factory=dict)
    # The entries' keys in sorted order, so those under a scope (a loop iteration, a
    # race's losing branches) are found without looking through every entry: built when
    # first asked for (an instance without loops or races never needs it), then kept.
    sorted_keys: list[str] | None = field(default=None, compare=False, repr=False)
    # Whether this object's own writes put the instance in the active index: then the
    # next ones need not put it again (a state read from storage puts it once more).
    active_stored: bool = field(default=False, compare=False, repr=False)

    # ---- the state machine ----------------------------------------------------------

    def _transition_to(self, status: Status) -> None:
        if status is self.status:
            return
        if status not in _ALLOWED[self.status]:
            raise InvalidTransition(
                f"instance {self.instance_id}: {self.status.value} -> {status.value} "
                "is not a valid transition"
            )
        self.status = status

    def apply(self, record: HistoryRecord) -> None:
        """Fold one record into the state. Records at or below ``seq`` are ignored, so
        applying a history twice (restore after a crash) changes nothing."""
        if record.seq <= self.seq:
            return
        self.seq = record.seq
        self.updated_ms = record.time_ms
        command_id = record.command_id
        if command_id and (not self.recent_commands or self.recent_commands[-1] != command_id):
            self.recent_commands.append(command_id)
            if is_client_command(command_id):
                self.new_commands.add(command_id)
        match record:
            case WorkflowStarted():
                self.workflow = record.workflow
                self.version = record.version
                self.input = record.input
                self.new_input = True
                self.created_ms = record.time_ms
                self.status = Status.PENDING
                self.traceparent = record.traceparent
                self.tracestate = record.tracestate
                parent = parse_child_command(record.command_id)
                if parent is not None:
                    self.parent_id, self.parent_key = parent
            case MessageWaitStarted():
                self._running()
                entry = self._entry(record.key, EntryKind.WAIT, EntryState.WAITING, record.seq)
                entry.names = list(record.names)
                self._open_wait(entry)
                entry.max_attempts = record.max
                if record.timeout_at_ms is not None:
                    entry.timer_id = timer_id(self.instance_id, "wait", record.key, record.seq)
                    entry.fire_at_ms = record.timeout_at_ms
            case MessagesReceived():
                entry = self._touch(record.key)
                entry.state = EntryState.SATISFIED
                entry.timer_id = entry.fire_at_ms = None
                entry.messages = list(
                    zip(record.ids, record.names, record.payloads, record.sent_ms, strict=True)
                )
                self._take_buffered(record.ids)
            case MessageSent():
                entry = self._entry(record.key, EntryKind.SENT, EntryState.RECORDED, record.seq)
                entry.child_id = record.target
                entry.event_name = record.name
                entry.result = record.payload
            case MessageCompleted():
                key = reply_key(record.message_id)
                entry = self._entry(key, EntryKind.VALUE, EntryState.RECORDED, record.seq)
                entry.result = record.result
                self.new_replies[record.message_id] = record.result
            case ChildStarted():
                self._running()
                entry = self._entry(record.key, EntryKind.CHILD, EntryState.RECORDED, record.seq)
                entry.child_id = record.child_id
                entry.event_name = record.workflow
                entry.result = record.input
            case StepAttemptStarted():
                self._running()
                entry = self._entry(record.key, EntryKind.STEP, EntryState.RUNNING, record.seq)
                entry.state = EntryState.RUNNING
                entry.attempt = record.attempt
                entry.max_attempts = record.max_attempts
                entry.timer_id = entry.fire_at_ms = None
            case StepSucceeded():
                entry = self.entries.get(record.key) or self._entry(
                    record.key, EntryKind.STEP, EntryState.SUCCEEDED, record.seq
                )  # an ephemeral step records nothing before its result
                self.dirty_entries.add(record.key)
                entry.attempt = entry.attempt or record.attempt
                entry.state = EntryState.SUCCEEDED
                entry.result = record.result
            case StepFailed():
                entry = self._touch(record.key)
                entry.error_type = record.error_type
                entry.error_message = record.error_message
                if record.next_attempt_at_ms is None:
                    entry.state = EntryState.FAILED
                else:
                    entry.state = EntryState.BACKOFF
                    entry.timer_id = timer_id(self.instance_id, "retry", record.key, entry.attempt)
                    entry.fire_at_ms = record.next_attempt_at_ms
            case SleepStarted():
                self._running()
                entry = self._entry(record.key, EntryKind.SLEEP, EntryState.SLEEPING, record.seq)
                entry.timer_id = timer_id(self.instance_id, "sleep", record.key, record.seq)
                entry.fire_at_ms = record.wake_at_ms
            case SleepElapsed():
                entry = self._touch(record.key)
                entry.state = EntryState.ELAPSED
                entry.timer_id = entry.fire_at_ms = None
            case WaitStarted():
                self._running()
                entry = self._entry(record.key, EntryKind.WAIT, EntryState.WAITING, record.seq)
                entry.event_name = record.event_name
                self._open_wait(entry)
                if record.timeout_at_ms is not None:
                    entry.timer_id = timer_id(self.instance_id, "wait", record.key, record.seq)
                    entry.fire_at_ms = record.timeout_at_ms
            case WaitSatisfied():
                entry = self._touch(record.key)
                entry.state = EntryState.SATISFIED
                entry.result = record.payload
                entry.timer_id = entry.fire_at_ms = None
                self._take_buffered((record.event_command_id,))
            case WaitTimedOut():
                entry = self._touch(record.key)
                entry.state = EntryState.TIMED_OUT
                entry.timer_id = entry.fire_at_ms = None
            case EventBuffered():
                event = BufferedEvent(
                    record.event_name,
                    record.payload,
                    record.command_id,
                    record.seq,
                    record.time_ms,
                )
                self.buffered.append(event)
                self.new_buffered.append(event)
            case RaceDecided():
                entry = self._entry(record.key, EntryKind.RACE, EntryState.RECORDED, record.seq)
                entry.winner = record.winner
                entry.losers = list(record.losers)
                for other in self.under(record.losers):
                    if not other.state.final:
                        other.state = EntryState.ABANDONED
                        other.timer_id = other.fire_at_ms = None
                        self.dirty_entries.add(other.key)
            case LoopAdvanced():
                self._loop_advanced(record)
            case ValueRecorded():
                self._running()
                entry = self._entry(record.key, EntryKind.VALUE, EntryState.RECORDED, record.seq)
                entry.result = record.value
            case WorkflowPaused():
                self._transition_to(Status.PAUSED)
            case WorkflowResumed():
                self._transition_to(Status.RUNNING)
            case WorkflowCompleted():
                self._transition_to(Status.COMPLETED)
                self.finished_ms = record.time_ms
                self.result = record.result
            case WorkflowFailed():
                self._transition_to(Status.FAILED)
                self.finished_ms = record.time_ms
                self.error_type = record.error_type
                self.error_message = record.error_message
            case WorkflowCancelled():
                self._transition_to(Status.CANCELLED)
                self.finished_ms = record.time_ms
                self.cancel_reason = record.reason
            case _:
                pass

    def _loop_advanced(self, record: LoopAdvanced) -> None:
        entry = self._entry(record.key, EntryKind.LOOP, EntryState.RECORDED, record.seq)
        ended = record.iteration - 1
        entry.attempt = record.iteration
        entry.result = record.state
        marks = entry.marks = entry.marks or {}
        marks[ended] = record.seq
        # Iterations below ``before`` are pruned; ``max_attempts`` keeps how far it got.
        before = max(record.iteration - max(record.keep, 1), 0)
        if before <= entry.max_attempts:
            return
        pruned = self.under(
            [p for j in range(entry.max_attempts, before) for p in loop_prefixes(record.key, j)]
        )
        # The stored history from just after the last pruned iteration (or the first
        # record of these) through the LoopAdvanced that ended iteration ``before - 1``.
        boundary = marks.get(entry.max_attempts - 1)
        starts = [e.seq for e in pruned] + [
            marks[j] for j in range(entry.max_attempts, before) if j in marks
        ]
        low = boundary + 1 if boundary is not None else min(starts, default=record.seq)
        high = marks.get(before - 1, low - 1) + 1
        for e in pruned:
            del self.entries[e.key]
            self.dirty_entries.discard(e.key)
            self.deleted_entries.add(e.key)
        self._unsort(pruned)
        for j in [j for j in marks if j < before - 1]:
            del marks[j]
        if high > low:
            self.pruned_history.append((low, high))
        entry.max_attempts = before

    def _take_buffered(self, command_ids: Iterable[str]) -> None:
        """Remove the buffered events of these commands. The code takes the oldest of a
        name, near the front: the search stops once it found them all, so draining a
        long buffer does not walk it once per event."""
        wanted = set(command_ids)
        buffered = self.buffered
        index = 0
        while wanted and index < len(buffered):
            event = buffered[index]
            if event.command_id in wanted:
                wanted.discard(event.command_id)
                self.taken_buffered.append(event.seq)
                del buffered[index]
            else:
                index += 1

    def _running(self) -> None:
        if self.status is Status.PENDING:
            self._transition_to(Status.RUNNING)

    def _entry(self, key: str, kind: EntryKind, state: EntryState, seq: int) -> Entry:
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = Entry(key, kind, state, seq)
            if self.sorted_keys is not None:
                insort(self.sorted_keys, key)
        self.dirty_entries.add(key)
        return entry

    def under(self, prefixes: Iterable[str]) -> list[Entry]:
        """The entries whose keys start with one of ``prefixes`` (scope prefixes), each
        once, in the order they were recorded: found by bisection in the sorted keys, so
        the cost follows what is found, not how many entries the instance has."""
        ordered = self.sorted_keys
        if ordered is None:
            ordered = self.sorted_keys = sorted(self.entries)
        found: dict[str, Entry] = {}
        for prefix in prefixes:
            at = bisect_left(ordered, prefix)
            while at < len(ordered) and ordered[at].startswith(prefix):
                key = ordered[at]
                found[key] = self.entries[key]
                at += 1
        return sorted(found.values(), key=_by_seq)

    def _unsort(self, gone: list[Entry]) -> None:
        ordered = self.sorted_keys
        if ordered is None or not gone:
            return
        removed = {e.key for e in gone}
        low = bisect_left(ordered, min(removed))
        high = bisect_left(ordered, max(removed)) + 1
        # The removed keys sit in one or a few runs: only that stretch is rebuilt.
        ordered[low:high] = [key for key in ordered[low:high] if key not in removed]

    def _touch(self, key: str) -> Entry:
        self.dirty_entries.add(key)
        return self.entries[key]

    # ---- queries --------------------------------------------------------------------

    def waiting_for(self, name: str) -> list[Entry]:
        """The entries waiting now for an event or a message called ``name``."""
        waits = self.open_waits.get(name)
        if not waits:
            return []
        found = []
        for key, entry in list(waits.items()):
            if entry.state is not EntryState.WAITING or self.entries.get(key) is not entry:
                del waits[key]  # satisfied, timed out, abandoned or pruned
            else:
                found.append(entry)
        if not waits:
            del self.open_waits[name]
        return found

    def _open_wait(self, entry: Entry) -> None:
        names = entry.names if entry.names is not None else [entry.event_name or ""]
        for name in names:
            self.open_waits.setdefault(name, {})[entry.key] = entry

    def open_entries(self) -> list[Entry]:
        return [e for e in self.entries.values() if not e.state.final]

    def pending_timers(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.timer_id is not None and not e.state.final]

    def pending_timer(self, fired: str) -> Entry | None:
        """The open entry whose timer this is. A timer id names its entry's key
        (``timer_id``), so a fire finds its entry without looking through every entry;
        an id of another form (state of older code) is looked for among them all."""
        parts = split_timer_id(self.instance_id, fired)
        entry = self.entries.get(parts[1]) if parts is not None else None
        if entry is None:
            return next((e for e in self.pending_timers() if e.timer_id == fired), None)
        # Only the entry the id names can hold it (a late or duplicate fire: none).
        return entry if entry.timer_id == fired and not entry.state.final else None

    # ---- storage --------------------------------------------------------------------

    def meta_json(self) -> bytes:
        raw: dict[str, Any] = {
            "w": self.workflow,
            "v": self.version,
            "st": self.status,
            "c": self.created_ms,
            "u": self.updated_ms,
            "q": self.seq,
            "r": _payload_json(self.result),
            "et": self.error_type,
            "em": self.error_message,
            "cr": self.cancel_reason,
            "fm": self.finished_ms,
            "pk": self.parked,
            "pi": [self.parent_id, self.parent_key] if self.parent_id else None,
            "tp": [self.traceparent, self.tracestate] if self.traceparent else None,
            "bn": len(self.buffered) + self.unread_buffered,
            "rc": list(self.recent_commands),
        }
        return orjson.dumps(raw)

    @classmethod
    def from_storage(
        cls,
        instance_id: str,
        meta: bytes,
        entries: list[tuple[str, bytes]],
        input: bytes | None = None,
        buffered: list[bytes] | None = None,
    ) -> InstanceState:
        """``input``: the value of the instance's input key; ``buffered``: the values of
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
        state = cls(
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
            parent_id=(raw.get("pi") or ["", ""])[0],
            parent_key=(raw.get("pi") or ["", ""])[1],
            traceparent=(raw.get("tp") or [None, None])[0],
            tracestate=(raw.get("tp") or [None, None])[1],
            buffered=[
                BufferedEvent(b[0], _payload_req(b[1]), b[2], b[3], b[4] if len(b) > 4 else 0)
                for b in rows
            ],
        )
        state.recent_commands.extend(raw["rc"])
        # What an older meta held inline moves to keys of its own at the next write.
        state.new_input = inline is not None
        if inline_buffered is not None:
            state.new_buffered = list(state.buffered)
        elif buffered is None:
            state.unread_buffered = raw.get("bn", 0)
        for key, value in entries:
            entry = state.entries[key] = Entry.from_json(key, orjson.loads(value))
            if entry.state is EntryState.WAITING:
                state._open_wait(entry)
        return state


def _by_seq(entry: Entry) -> int:
    return entry.seq


def entry_json(entry: Entry) -> bytes:
    return orjson.dumps(entry.to_json())


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
