"""The inputs an instance runtime handles, one handler per kind, in a table: the
commands (start, event, cancel, pause, resume, timer fired) and step outcomes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stepstream.engine.replay.effects import LOST_PURPOSE, StepOutcome
from stepstream.engine.replay.ids import parse_child_command, split_timer_id
from stepstream.engine.replay.state import EntryState, Status
from stepstream.engine.wire.codec import (
    clip_message,
)
from stepstream.engine.wire.records import (
    CancelWorkflow,
    EventBuffered,
    PauseWorkflow,
    ResumeWorkflow,
    SendEvent,
    SleepElapsed,
    StartWorkflow,
    TimerFired,
    WaitTimedOut,
    WorkflowCancelledRecord,
    WorkflowPaused,
    WorkflowResumed,
    WorkflowStarted,
)
from stepstream.engine.wire.records import StepSucceeded as StepSucceededRecord

if TYPE_CHECKING:
    from stepstream.engine.replay.runtime import InstanceRuntime


def on_start(rt: InstanceRuntime, msg: StartWorkflow) -> None:
    if rt.state.workflow:
        rt._ignore(msg, f"instance already exists (status {rt.state.status.value})")
        asker = parse_child_command(msg.command_id)
        if asker is not None and asker != (rt.state.parent_id, rt.state.parent_key):
            rt._refuse_child(msg, *asker)
        elif rt.state.status.finished and rt.state.parent_id:
            rt._notify_parent()  # a parent's new owner asks again: answer again
        return
    assert rt.definition is not None
    rt._emit(
        WorkflowStarted,
        workflow=rt.definition.name,
        version=rt.definition.version,
        input=msg.input,
    )
    rt._drive()


def on_event(rt: InstanceRuntime, msg: SendEvent) -> None:
    if rt.state.status.finished:
        rt._ignore(msg, f"instance is {rt.state.status.value}")
        return
    waiting = rt.state.waiting_for(msg.name)
    if not waiting or rt.state.status is Status.PAUSED:
        # Held until a wait takes it (a paused instance takes nothing: on resume,
        # the waits take what arrived meanwhile, in order).
        rt._emit(EventBuffered, event_name=msg.name, payload=msg.payload)
        return
    entry = min(waiting, key=lambda e: e.seq)
    if entry.names is not None:
        now = rt.clock.now_ms()
        rt._receive(entry, [(msg.command_id, msg.name, msg.payload, now)])
    else:
        rt._satisfy(entry, msg.payload, msg.command_id)
    rt._drive()


def on_cancel(rt: InstanceRuntime, msg: CancelWorkflow) -> None:
    if rt.state.status.finished:
        rt._ignore(msg, f"instance is {rt.state.status.value}")
        return
    # Cancelling a parent cancels its children.
    rt._cancel_children(rt._waited_children(), f"its parent {rt.state.instance_id} was cancelled")
    rt._finish(WorkflowCancelledRecord, reason=clip_message(msg.reason))


def on_pause(rt: InstanceRuntime, msg: PauseWorkflow) -> None:
    if rt.state.status.finished or rt.state.status is Status.PAUSED:
        rt._ignore(msg, f"instance is {rt.state.status.value}")
        return
    rt._emit(WorkflowPaused)
    # The coroutine is dropped; resume replays it from the recorded history.
    rt.close()


def on_resume(rt: InstanceRuntime, msg: ResumeWorkflow) -> None:
    if rt.state.status is not Status.PAUSED:
        rt._ignore(msg, f"instance is {rt.state.status.value}, not paused")
        return
    rt._emit(WorkflowResumed)
    rt._drive_with_retries_due()


def on_timer(rt: InstanceRuntime, msg: TimerFired) -> None:
    if rt.state.status.finished:
        return
    entry = rt.state.pending_timer(msg.timer_id)
    if entry is None:
        _on_lost_timer(rt, msg.timer_id)
        return  # cancelled, superseded or already fired: a duplicate fire is harmless
    if entry.fire_at_ms is not None and msg.fire_at_ms < entry.fire_at_ms:
        return  # a fire of an older schedule: the timer is not due yet
    if entry.state is EntryState.SLEEPING:
        rt._emit(SleepElapsed, key=entry.key)
        rt._resolve(entry)
    elif entry.state is EntryState.WAITING:
        rt._emit(WaitTimedOut, key=entry.key)
        rt._resolve(entry)
    elif entry.state is EntryState.BACKOFF:
        if rt.state.status is Status.PAUSED:
            return  # resume replays and starts overdue retries
        intent = rt._intents.get(entry.key)
        if rt.draining:
            rt._schedule(entry, "retry")  # armed again: it fires for the next owner
            return
        if intent is None or rt._task is None:
            rt._drive_with_retries_due()  # replay re-creates the intent and starts it
            return
        rt._start_attempt(entry.key, intent, entry.attempt + 1)
    rt._drive()


def _on_lost_timer(rt: InstanceRuntime, fired: str) -> None:
    """The timer recover() set for an attempt lost with the previous owner: the loss
    is recorded now, and the next attempt starts (or the step fails for good)."""
    parts = split_timer_id(rt.state.instance_id, fired)
    if parts is None or parts[0] != LOST_PURPOSE:
        return
    entry = rt.state.entries.get(parts[1])
    if (
        entry is None
        or entry.state is not EntryState.RUNNING
        or fired != rt._lost_timer_id(entry)  # a fire for an earlier attempt
        or (entry.key, entry.attempt) in rt.inflight
    ):
        return  # its outcome came after all, or a duplicate fire
    if rt.state.status is Status.PAUSED:
        return  # resume replays and decides the lost attempt
    if rt._task is None:
        rt._drive()  # the replay finds the attempt lost and decides it now
        return
    rt._lose(entry)
    rt._drive()


def on_outcome(rt: InstanceRuntime, o: StepOutcome) -> None:
    entry = rt.state.entries.get(o.key)
    rt.inflight.discard((o.key, o.attempt))
    if entry is None and rt._ephemeral.get(o.key) == o.attempt:
        del rt._ephemeral[o.key]
        if rt.state.status.finished:
            return
        if o.result is None:
            # A failed ephemeral attempt is recorded like any other, and retried
            # durably from here on.
            intent = rt._intents.get(o.key)
            if intent is None:
                return
            rt._record_attempt(o.key, intent, o.attempt)
            entry = rt.state.entries[o.key]
        else:
            rt._emit(StepSucceededRecord, key=o.key, attempt=o.attempt, result=o.result)
            rt._resolve(rt.state.entries[o.key])
            rt._drive()
            return
    if (
        entry is None
        or entry.state is not EntryState.RUNNING
        or entry.attempt != o.attempt
        or rt.state.status.finished
    ):
        return
    if o.result is not None:
        rt._emit(StepSucceededRecord, key=o.key, attempt=o.attempt, result=o.result)
        rt._resolve(entry)
    else:
        rt._fail_attempt(entry, o.error_type, o.error_message, o.retryable, traceback=o.traceback)
    rt._drive()


Handler = Callable[["InstanceRuntime", Any], None]

# One handler per kind of input; ``InstanceRuntime.handle`` looks the input's type up here.
HANDLERS: dict[type, Handler] = {
    StepOutcome: on_outcome,
    TimerFired: on_timer,
    StartWorkflow: on_start,
    SendEvent: on_event,
    CancelWorkflow: on_cancel,
    PauseWorkflow: on_pause,
    ResumeWorkflow: on_resume,
}
