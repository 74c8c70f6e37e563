"""Reset, retry and fork: an instance going on from an earlier point of its history.

A reset to replay key K sets aside every record from K's first record (``from_seq``) up
to the ``WorkflowReset`` that says so: they stay in the history, shown as set aside, and
no longer count for replay. The state after it is ``fold`` of the whole history, which
folds only the records that still count, so the hot path (``on_reset``) and a restore
from the history topic (``consumers.restore``) reach the same state. What was set aside
leaves two traces in that state:

- attempt numbers: each step key's attempts go on counting above the highest set aside
  (``InstanceState.attempt_floors``), so the outcome of an attempt that was running
  when the reset came can never be taken for one of the run that goes on (it is
  ignored), while the step gets a fresh budget of attempts;
- events: those that reached a wait set aside are buffered again, in the order they
  came, so the code that runs on receives them again (nothing sent is lost).

A retry is a reset of a failed instance to its failed step (the newest step that failed
for good), or, if no step failed, to just before the failure. A fork copies the records
before the key (set-aside ones too, with their seqs, so the copy folds to the same state)
into a new instance, which notes its origin (``WorkflowForked``) and runs on.

Timers of what was set aside are cancelled and running attempts given up. Children that
were started after the key keep running: the code that runs on starts the same child
id again (its id comes from the key), which attaches to it rather than starting another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from stepstream.engine.replay.effects import TIMER_PURPOSES
from stepstream.engine.replay.ids import TIMER_FIRE_PREFIX
from stepstream.engine.replay.slots import GivenBack, give_back, given_back
from stepstream.engine.replay.state import (
    BufferedEvent,
    EntryKind,
    EntryState,
    InstanceState,
    Status,
)
from stepstream.engine.wire.records import (
    EventBuffered,
    ForkWorkflow,
    HistoryRecord,
    MessagesReceived,
    Record,
    ResetWorkflow,
    RetryWorkflow,
    StartFork,
    StepAttemptStarted,
    StepSucceeded,
    TimerCancelled,
    WaitSatisfied,
    WorkflowForked,
    WorkflowReset,
    WorkflowRestarted,
    WorkflowStarted,
)
from stepstream.engine.wire.settle import NO_SUCH_KEY, NOT_FAILED

if TYPE_CHECKING:
    from stepstream.engine.replay.runtime import InstanceRuntime

# How many of an instance's keys a refusal names.
_KEYS_SHOWN = 30


class HistoryAccess(Protocol):
    """What a reset or fork reads beyond the state: the instance's stored history, and
    records as bytes (a fork's copy travels inside a command)."""

    def stored(self, instance_id: str) -> list[HistoryRecord]: ...

    def encode(self, record: Record) -> bytes: ...

    def decode(self, value: bytes) -> Record: ...


# ---- the fold ------------------------------------------------------------------------


def set_aside(records: Iterable[HistoryRecord]) -> set[int]:
    """The seqs of the records a ``WorkflowReset`` among ``records`` set aside."""
    aside: set[int] = set()
    for record in records:
        if isinstance(record, WorkflowReset):
            aside.update(range(record.from_seq, record.seq))
    return aside


def fold(instance_id: str, records: Sequence[HistoryRecord]) -> InstanceState:
    """The state of an instance whose history is ``records`` (in seq order), resets
    included: what a reset set aside is not folded, but its attempt numbers count and
    its command ids stay applied."""
    aside = set_aside(records)
    state = InstanceState(instance_id)
    floors: dict[str, int] = {}
    slots = GivenBack()
    for record in records:
        slots.see(record, record.seq in aside)
        if record.seq not in aside:
            state.apply(record)
            if isinstance(record, WorkflowRestarted):
                floors.clear()  # set aside in an earlier run: its attempts are not this one's
            continue
        if isinstance(record, StepAttemptStarted | StepSucceeded):
            floors[record.key] = max(floors.get(record.key, 0), record.attempt)
        # A set-aside command id stays applied: re-delivered, it changes nothing. Not a
        # timer's fire: the timer is armed again if what waits on it is before the reset
        # point (a sleep, a backoff, the run's timeout), and its fire, of the same id,
        # must then take effect.
        command_id = record.command_id
        if (
            command_id
            and not command_id.startswith(TIMER_FIRE_PREFIX)
            and command_id not in state.recent_commands
        ):
            state.recent_commands.append(command_id)
    state.attempt_floors = floors
    give_back(state, sorted(slots.slots))
    return state


def redeliveries(state: InstanceState, records: Sequence[HistoryRecord]) -> list[BufferedEvent]:
    """The events and messages that set-aside records of the reset ending ``records``
    buffered or delivered and ``state`` does not hold, in the order they came: the
    reset buffers them again (``EventBuffered``), so the code that runs on gets them."""
    reset = records[-1]
    assert isinstance(reset, WorkflowReset)
    held = {event.command_id for event in state.buffered}
    # An admission to a slot given back is not the run's: the code asks again.
    slots = given_back(records, set_aside(records))
    found: list[BufferedEvent] = []
    for record in records:
        if not reset.from_seq <= record.seq < reset.seq:
            continue
        if isinstance(record, EventBuffered):
            found.append(
                BufferedEvent(record.event_name, record.payload, record.command_id, record.seq)
            )
        elif isinstance(record, WaitSatisfied) and record.event_command_id:
            found.append(
                BufferedEvent(
                    record.event_name, record.payload, record.event_command_id, record.seq
                )
            )
        elif isinstance(record, MessagesReceived) and record.key not in slots:
            found.extend(
                BufferedEvent(name, payload, message_id, record.seq)
                for message_id, name, payload in zip(
                    record.ids, record.names, record.payloads, strict=True
                )
            )
    again = []
    for event in found:
        if event.command_id not in held:
            held.add(event.command_id)
            again.append(event)
    return again


def reset_state(old: InstanceState, records: Sequence[HistoryRecord]) -> InstanceState:
    """The state after a reset (the last of ``records``, the whole history), with what
    must change in storage marked against ``old``: every entry of the new state written,
    the old ones it lacks deleted, the buffered events replaced, a finish taken back."""
    new = fold(old.instance_id, records)
    new.parked = old.parked  # the owner's, not history's: cleared when matching code loads it
    new.dirty_entries = set(new.entries)
    new.deleted_entries = set(old.entries) - set(new.entries)
    kept = {event.seq for event in new.buffered}
    new.taken_buffered = [event.seq for event in old.buffered if event.seq not in kept]
    new.new_buffered = list(new.buffered)
    # Stored already, unless ``old`` began in the same fold (a restore from scratch).
    new.new_input = old.new_input
    new.new_commands.clear()  # stored already, when they were applied
    new.new_replies.clear()
    new.pruned_history = []
    new.indexed_created_ms = old.indexed_created_ms  # the store's, not history's
    if old.status.finished:
        new.unfinished_ms = old.finished_ms
    return new


# ---- where a reset goes to -------------------------------------------------------------


def keys_named(state: InstanceState) -> str:
    """The replay keys a reset or fork may go to, oldest first, for a refusal."""
    keys = [
        e.key for e in sorted(state.entries.values(), key=lambda e: e.seq) if _resettable(e.key)
    ]
    shown = ", ".join(keys[:_KEYS_SHOWN]) or "none"
    if len(keys) > _KEYS_SHOWN:
        shown += f", ... ({len(keys) - _KEYS_SHOWN} more)"
    return shown


def _resettable(key: str) -> bool:
    return not key.startswith("~")  # patch markers and answers: no place to go on from


def reset_point(state: InstanceState, key: str) -> int | str:
    """The first seq that a reset or fork to ``key`` sets aside, or why there is none."""
    entry = state.entries.get(key)
    if entry is None or not _resettable(key):
        return (
            f"{NO_SUCH_KEY} instance {state.instance_id} has no replay key {key!r} in its "
            f"history; its keys: {keys_named(state)} (see `stepstream history "
            f"{state.instance_id}`)"
        )
    return entry.seq


def retry_point(state: InstanceState) -> tuple[str, int] | str:
    """Where a retry goes on from: the newest step that failed for good (key and its
    first seq), or "" and the failure record's seq; or why the instance cannot be
    retried."""
    if state.status is not Status.FAILED:
        return (
            f"{NOT_FAILED} instance {state.instance_id} is {state.status.value}, not failed; "
            "only a failed instance can be retried (to run it on from one of its steps, "
            f"use `stepstream reset {state.instance_id} --to KEY`)"
        )
    failed = [
        e
        for e in state.entries.values()
        if e.kind is EntryKind.STEP and e.state is EntryState.FAILED and _resettable(e.key)
    ]
    if failed:
        newest = max(failed, key=lambda e: e.seq)
        return newest.key, newest.seq
    # Just before the WorkflowFailed record (the instance's last), and before the queue
    # slots the code gave back as the exception went up (``holding``): the code that
    # runs again asks for them again rather than go on past its own release.
    released = {
        e.seq
        for e in state.entries.values()
        if e.kind is EntryKind.SENT and e.key.endswith("#release")
    }
    first = state.seq
    while first - 1 in released:
        first -= 1
    return "", first


# ---- the inputs ------------------------------------------------------------------------


def _history(rt: InstanceRuntime) -> list[HistoryRecord]:
    """The instance's whole history: what is stored, and what this batch decided."""
    assert rt.history is not None, "a reset needs the history (RuntimeCache.history)"
    instance_id = rt.state.instance_id
    records = {r.seq: r for r in rt.history.stored(instance_id)}
    for record in rt._out.history:
        if record.instance_id == instance_id:
            records[record.seq] = record
    return [records[seq] for seq in sorted(records)]


def on_reset(rt: InstanceRuntime, msg: ResetWorkflow | RetryWorkflow) -> None:
    state = rt.state
    if isinstance(msg, RetryWorkflow):
        point = retry_point(state)
        if isinstance(point, str):
            rt._ignore(msg, point)
            return
        key, from_seq = point
    else:
        found = reset_point(state, msg.to)
        if isinstance(found, str):
            rt._ignore(msg, found)
            return
        key, from_seq = msg.to, found
    record = WorkflowReset(
        instance_id=state.instance_id,
        seq=state.seq + 1,
        time_ms=rt.clock.now_ms(),
        command_id=rt._command_id,
        epoch=rt.epoch,
        traceparent=None if rt._traceparent == state.traceparent else rt._traceparent,
        tracestate=None if rt._traceparent == state.traceparent else rt._tracestate,
        to=key,
        from_seq=from_seq,
        reason=msg.reason,
        retry=isinstance(msg, RetryWorkflow),
    )
    history = [*_history(rt), record]
    new = reset_state(state, history)
    _go_on(rt, new, record, redeliveries(new, history))


def _go_on(
    rt: InstanceRuntime, new: InstanceState, record: HistoryRecord, again: list[BufferedEvent]
) -> None:
    """Replace the runtime's state with ``new`` (``record`` made it): what the old one
    waited for and ran that the new one does not is given up, the events ``again`` are
    buffered again, and the code runs on."""
    old = rt.state
    armed = {e.timer_id for e in new.pending_timers()}
    for entry in old.pending_timers():
        if entry.timer_id not in armed:
            assert entry.timer_id is not None
            rt._timer(TimerCancelled, timer_id=entry.timer_id)
    for key, attempt in sorted(rt.inflight):
        now = new.entries.get(key)
        if now is None or now.state is not EntryState.RUNNING or now.attempt != attempt:
            rt._out.cancels.append((old.instance_id, key, attempt))
            rt.inflight.discard((key, attempt))  # its outcome is ignored when it comes
    for key, attempt in rt._ephemeral.items():
        rt._out.cancels.append((old.instance_id, key, attempt))
    rt._ephemeral.clear()
    rt.close()
    rt._intents.clear()
    rt.state = new
    rt._out.history.append(record)
    for entry in new.pending_timers():
        purpose = TIMER_PURPOSES.get(entry.state)
        if purpose is not None:
            rt._schedule(entry, purpose)
    caused_by = rt._command_id
    for event in again:
        rt._command_id = event.command_id  # as the event came: a wait takes it by this id
        rt._emit(EventBuffered, event_name=event.name, payload=event.payload)
    rt._command_id = caused_by
    rt._drive()


def on_fork(rt: InstanceRuntime, msg: ForkWorkflow) -> None:
    """At the source: send the new instance the records before the key."""
    state = rt.state
    found = reset_point(state, msg.to)
    if isinstance(found, str):
        rt._ignore(msg, found)
        return
    assert rt.history is not None
    prefix = [r for r in _history(rt) if r.seq < found]
    start = StartFork(
        instance_id=msg.new_id,
        time_ms=rt.clock.now_ms(),
        command_id=msg.command_id,  # applied once by the new instance
        epoch=rt.epoch,
        traceparent=msg.traceparent,
        tracestate=msg.tracestate,
        source_id=state.instance_id,
        to=msg.to,
        records=[rt.history.encode(r) for r in prefix],
    )
    rt._out.commands.append((state.instance_id, start))


def fork_records(msg: StartFork, decode: HistoryAccess, epoch: int) -> list[HistoryRecord]:
    """The source's records of ``msg`` as the new instance's: its id, this owner's epoch,
    and a start caused by the fork (not by the source's parent, if it had one)."""
    copies: list[HistoryRecord] = []
    for value in msg.records:
        record = decode.decode(value)
        if not isinstance(record, HistoryRecord):
            continue
        changes: dict[str, object] = {"instance_id": msg.instance_id, "epoch": epoch}
        if isinstance(record, WorkflowStarted):
            changes["command_id"] = msg.command_id
        copies.append(dataclasses.replace(record, **changes))  # type: ignore[arg-type]
    return copies


def on_start_fork(rt: InstanceRuntime, msg: StartFork) -> None:
    """At the new instance: its history is the copy, then ``WorkflowForked``."""
    if rt.state.workflow:
        rt._ignore(msg, f"instance already exists (status {rt.state.status.value})")
        return
    assert rt.history is not None
    copies = fork_records(msg, rt.history, rt.epoch)
    state = fold(msg.instance_id, copies)
    state.indexed_created_ms = rt.state.indexed_created_ms
    from_seq = copies[-1].seq + 1 if copies else 1
    marker = WorkflowForked(
        instance_id=msg.instance_id,
        seq=max(state.seq + 1, from_seq),
        time_ms=rt.clock.now_ms(),
        command_id=msg.command_id,
        epoch=rt.epoch,
        source_id=msg.source_id,
        to=msg.to,
        from_seq=from_seq,
    )
    rt._out.history.extend(copies)
    state.apply(marker)
    rt.state = state
    rt._out.history.append(marker)
    # Children the source started and did not hear from yet are the source's: asked,
    # each tells the fork so (ChildFailed) rather than leave it waiting for ever.
    for entry in rt._waited_children():
        rt._out.commands.append((msg.instance_id, rt._child_start(entry)))
    for entry in state.pending_timers():
        purpose = TIMER_PURPOSES.get(entry.state)
        if purpose is not None:
            rt._schedule(entry, purpose)
    rt._drive()
