"""Instance state: the fold of an instance's history records into ``InstanceState``.

``InstanceState.apply`` is the only way state changes, both on the hot path (records the
runtime just decided) and on restore (records read back from the history topic), so a
restored instance is exactly the instance that was lost. How the state is stored and read
back is ``engine.replay.state_json``'s; the ids it derives (timers, child starts, message
answers) are ``engine.replay.ids``'s, the status machine ``engine.replay.status``'s, the
entries it holds per replay key ``engine.replay.entries``'.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from stepstream.engine.api.queues import QUEUE_ADMITTED

# The entries and the status machine are modules of their own; readers of the state
# import them from here too.
from stepstream.engine.replay.entries import BufferedEvent as BufferedEvent
from stepstream.engine.replay.entries import Entry as Entry
from stepstream.engine.replay.entries import EntryKind as EntryKind
from stepstream.engine.replay.entries import EntryState as EntryState
from stepstream.engine.replay.ids import (
    RUN_TIMEOUT_KEY,
    is_client_command,
    parse_child_command,
    reply_key,
    split_timer_id,
    timer_id,
)
from stepstream.engine.replay.key_order import KeyOrder
from stepstream.engine.replay.pruning import prune_iterations
from stepstream.engine.replay.slots import give_back, unreleased
from stepstream.engine.replay.status import InvalidTransition as InvalidTransition
from stepstream.engine.replay.status import Status as Status
from stepstream.engine.replay.status import check_transition
from stepstream.engine.wire.records import (
    AttributesSet,
    CallRemoved,
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
    StepFailedRecord,
    StepSucceeded,
    ValueRecorded,
    WaitSatisfied,
    WaitStarted,
    WaitTimedOut,
    WorkflowCancelledRecord,
    WorkflowCompleted,
    WorkflowFailedRecord,
    WorkflowForked,
    WorkflowPaused,
    WorkflowRestarted,
    WorkflowResumed,
    WorkflowStarted,
    WorkflowTerminatedRecord,
    WorkflowTimeoutSet,
)


def _admission(names: list[str]) -> bool:
    """Whether a message wait is for a queue's admission."""
    return bool(names) and names[0].startswith(QUEUE_ADMITTED)


RECENT_COMMANDS = 64


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
    # The run number: 1, and one more at each restart (WorkflowRestarted).
    run: int = 1
    # Paused while pending (not admitted by its queue yet): a resume makes it pending.
    paused_pending: bool = False
    # Why an unfinished instance cannot advance where it is owned now (its version is
    # not deployed there); "" when it can. Set by the owner, not by history.
    parked: str = ""
    # The parent of a child workflow, and the child's key in it ("" for other instances).
    parent_id: str = ""
    parent_key: str = ""
    # Where a queued workflow waits: (priority, queue key), from its start.
    queue_request: tuple[int, str | None] = (0, None)
    # The W3C trace context of the start: records caused by step outcomes and timer
    # fires (which carry none of their own) join the trace the client started.
    traceparent: str | None = None
    tracestate: str | None = None
    # A fork's origin: the instance its history was copied from, and the key there.
    forked_from: str = ""
    forked_at: str = ""
    # After a reset: per step key, the highest attempt number set aside in this run, so
    # the attempts of the code run on are numbered above it and an outcome of a
    # set-aside attempt is never taken for theirs (``engine.replay.reset``).
    attempt_floors: dict[str, int] = field(default_factory=dict)
    # Per queue slot, the highest of its asks that a reset or fork gave back: the code
    # asks again under the next key (``engine.replay.slots``).
    requeued: dict[str, int] = field(default_factory=dict)
    # The finish time a reset took back: its entry in the finished index goes.
    unfinished_ms: int = 0
    # Search attributes (``ctx.set_attributes``): kept in the meta, so a listing filters
    # on them without reading history.
    attributes: dict[str, str | int | float | bool] = field(default_factory=dict)
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
    # The entries' keys in sorted order, for those under a scope (``key_order``).
    key_order: KeyOrder = field(default_factory=KeyOrder, compare=False, repr=False)
    # Whether this object's own writes put the instance in the active index: then the
    # next ones need not put it again (a state read from storage puts it once more).
    active_stored: bool = field(default=False, compare=False, repr=False)
    # The created time under which the store's index by created time holds the instance
    # (-1: not in it), so a write moves its key only when a new run changed the time:
    # one compare per transition. Set from storage when read.
    indexed_created_ms: int = field(default=-1, compare=False, repr=False)
    # What every span of the run shares (``consumers/spans.py``, ``run_fields``): made
    # once, when a span first needs it, and forgotten when a run starts, the one change
    # of the fields it holds. Never stored.
    span_run: tuple[object, ...] | None = field(default=None, compare=False, repr=False)

    # ---- the state machine ----------------------------------------------------------

    def _transition_to(self, status: Status) -> None:
        check_transition(self.instance_id, self.status, status)
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
        # Each case is a type check, tried in order: a step's records (most of any
        # history) first, then a run's start and end.
        match record:
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
            case StepFailedRecord():
                entry = self._touch(record.key)
                entry.error_type = record.error_type
                entry.error_message = record.error_message
                if record.next_attempt_at_ms is None:
                    entry.state = EntryState.FAILED
                else:
                    entry.state = EntryState.BACKOFF
                    entry.timer_id = timer_id(self.instance_id, "retry", record.key, entry.attempt)
                    entry.fire_at_ms = record.next_attempt_at_ms
            case WorkflowStarted():
                self.workflow = record.workflow
                self.version = record.version
                self.input = record.input
                self.new_input = True
                self.created_ms = record.time_ms
                self.status = Status.PENDING
                self.queue_request = (record.priority or 0, record.queue_key)
                self.traceparent = record.traceparent
                self.tracestate = record.tracestate
                self.span_run = None
                parent = parse_child_command(record.command_id)
                if parent is not None:
                    self.parent_id, self.parent_key = parent
            case WorkflowCompleted():
                self._transition_to(Status.COMPLETED)
                self.finished_ms = record.time_ms
                self.result = record.result
            case MessageWaitStarted():
                if not _admission(record.names):  # waiting for a queue keeps it pending
                    self._running()
                entry = self._entry(record.key, EntryKind.WAIT, EntryState.WAITING, record.seq)
                entry.names = list(record.names)
                self.open_wait(entry)
                entry.max_attempts = record.max
                if record.timeout_at_ms is not None:
                    entry.timer_id = timer_id(self.instance_id, "wait", record.key, record.seq)
                    entry.fire_at_ms = record.timeout_at_ms
            case MessagesReceived():
                if _admission(record.names):
                    self._running()
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
                self.open_wait(entry)
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
                self._abandon(self.under(record.losers))
            case CallRemoved():
                self._abandon([self.entries[record.key]] if record.key in self.entries else [])
            case LoopAdvanced():
                self._loop_advanced(record)
            case ValueRecorded():
                self._running()
                entry = self._entry(record.key, EntryKind.VALUE, EntryState.RECORDED, record.seq)
                entry.result = record.value
            case AttributesSet():
                self._entry(record.key, EntryKind.VALUE, EntryState.RECORDED, record.seq)
                for name, value in record.attributes.items():
                    if value is None:
                        self.attributes.pop(name, None)
                    else:
                        self.attributes[name] = value
            case WorkflowPaused():
                self.paused_pending = self.status is Status.PENDING
                self._transition_to(Status.PAUSED)
            case WorkflowResumed():
                # Back to what it was: one its queue has not admitted yet is pending still.
                self._transition_to(Status.PENDING if self.paused_pending else Status.RUNNING)
                self.paused_pending = False
            case WorkflowFailedRecord():
                self._transition_to(Status.FAILED)
                self.finished_ms = record.time_ms
                self.error_type = record.error_type
                self.error_message = record.error_message
            case WorkflowForked():
                self.forked_from = record.source_id
                self.forked_at = record.to
                give_back(self, [slot for slot, _ in unreleased(self)])  # the source's
            case WorkflowCancelledRecord():
                self._transition_to(Status.CANCELLED)
                self.finished_ms = record.time_ms
                self.cancel_reason = record.reason
            case WorkflowTerminatedRecord():
                self._transition_to(Status.TERMINATED)
                self.finished_ms = record.time_ms
                self.cancel_reason = record.reason
            case WorkflowTimeoutSet():
                entry = self._entry(
                    RUN_TIMEOUT_KEY, EntryKind.SLEEP, EntryState.SLEEPING, record.seq
                )
                entry.timer_id = timer_id(self.instance_id, "timeout", RUN_TIMEOUT_KEY, record.seq)
                entry.fire_at_ms = record.timeout_at_ms
            case WorkflowRestarted():
                self._restart(record)
            case _:
                pass

    def _restart(self, record: WorkflowRestarted) -> None:
        """Set the previous run aside: its entries and unclaimed events are dropped from
        the state (its records stay in the history), so the next ``WorkflowStarted``
        begins a run that replays from nothing."""
        self._transition_to(Status.PENDING)
        self.run = record.run
        # The engine's own command ids (a step outcome, a timer fire) name a key and an
        # attempt or a seq, which the new run may use again: only the restart's stays
        # (client commands are also kept one key each, so they still apply once).
        self.recent_commands.clear()
        self.recent_commands.append(record.command_id)
        self.deleted_entries.update(self.entries)
        self.dirty_entries.clear()
        self.entries.clear()
        self.key_order.forget()
        self.open_waits.clear()
        self.taken_buffered.extend(event.seq for event in self.buffered)
        self.buffered.clear()  # stored ones taken; new ones are stored, then taken
        self.result = None
        self.error_type = self.error_message = self.cancel_reason = self.parked = ""
        self.finished_ms = 0
        self.attributes = {}  # the new run sets its own
        self.requeued = {}  # and asks its queues under keys of its own
        self.attempt_floors = {}  # and numbers its attempts from 1

    def _loop_advanced(self, record: LoopAdvanced) -> None:
        entry = self._entry(record.key, EntryKind.LOOP, EntryState.RECORDED, record.seq)
        entry.attempt = record.iteration
        entry.result = record.state
        prune_iterations(self, entry, record)

    def _abandon(self, entries: list[Entry]) -> None:
        """What the code will never reach again (a lost race branch, a removed call)."""
        for entry in entries:
            if not entry.state.final:
                entry.state = EntryState.ABANDONED
                entry.timer_id = entry.fire_at_ms = None
                self.dirty_entries.add(entry.key)

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
            self.deleted_entries.discard(key)  # a reset took it back, and it comes again
            self.key_order.added(key)
        self.dirty_entries.add(key)
        return entry

    def under(self, prefixes: Iterable[str]) -> list[Entry]:
        """The entries whose keys start with one of ``prefixes`` (scope prefixes), each
        once, in the order they were recorded."""
        return self.key_order.under(self.entries, prefixes)

    def drop(self, gone: list[Entry]) -> None:
        """Take ``gone`` out of the state (a loop's pruned iterations, admissions given
        back): the write that follows deletes them from storage."""
        for entry in gone:
            del self.entries[entry.key]
            self.dirty_entries.discard(entry.key)
            self.deleted_entries.add(entry.key)
        self.key_order.removed(e.key for e in gone)

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

    def open_wait(self, entry: Entry) -> None:
        """Index a waiting entry under each name it waits for (see ``open_waits``)."""
        for name in entry.waited_names:
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
