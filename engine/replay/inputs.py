"""The inputs an instance runtime handles, one handler per kind, in a table: the
commands (start, event, cancel, pause, resume, timer fired) and step outcomes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stepstream.engine.replay.effects import LOST_PURPOSE, StepOutcome
from stepstream.engine.replay.ids import (
    RUN_TIMEOUT_KEY,
    child_command_run,
    parse_child_command,
    split_timer_id,
)
from stepstream.engine.replay.reset import on_fork, on_reset, on_start_fork
from stepstream.engine.replay.state import EntryState, Status
from stepstream.engine.wire.codec import (
    clip_message,
)
from stepstream.engine.wire.records import (
    CancelWorkflow,
    EventBuffered,
    ForkWorkflow,
    PauseWorkflow,
    ResetWorkflow,
    ResumeWorkflow,
    RetryWorkflow,
    SendEvent,
    SleepElapsed,
    StartFork,
    StartWorkflow,
    TerminateWorkflow,
    TimerFired,
    WaitTimedOut,
    WorkflowCancelledRecord,
    WorkflowPaused,
    WorkflowRestarted,
    WorkflowResumed,
    WorkflowStarted,
    WorkflowTerminatedRecord,
    WorkflowTimeoutSet,
)
from stepstream.engine.wire.records import StepSucceeded as StepSucceededRecord
from stepstream.engine.wire.settle import REFUSED_START

if TYPE_CHECKING:
    from stepstream.engine.replay.runtime import InstanceRuntime


def on_start(rt: InstanceRuntime, msg: StartWorkflow) -> None:
    restart = msg.if_exists == "restart_if_failed" and rt.state.status.restartable
    if rt.state.workflow and restart:
        # The owner decides against the state it owns: two clients restarting at once
        # start one new run (the second finds it running).
        previous = rt.state.status.value
        rt.close()
        rt.stale_attempts |= rt.inflight
        rt._intents.clear()
        rt._ephemeral.clear()
        rt._emit(WorkflowRestarted, run=rt.state.run + 1, previous_status=previous)
    elif rt.state.workflow:
        policy = f"; {REFUSED_START}" if msg.if_exists == "fail" else ""
        other = ""
        if msg.workflow != rt.state.workflow:  # the policy looks at the id only
            other = f", workflow {rt.state.workflow!r}, not {msg.workflow!r}"
        status = rt.state.status.value
        rt._ignore(msg, f"instance already exists (status {status}{other}){policy}")
        asker = parse_child_command(msg.command_id)
        if asker is not None and asker != (rt.state.parent_id, rt.state.parent_key):
            rt._refuse_child(msg, *asker)
        elif rt.state.status.finished and rt.state.parent_id:
            # A parent's new owner, or its restarted run, asks again: answer again.
            rt._notify_parent(child_command_run(msg.command_id))
        return
    assert rt.definition is not None
    rt._emit(
        WorkflowStarted,
        workflow=rt.definition.name,
        version=rt.definition.version,
        input=msg.input,
        priority=msg.priority,
        queue_key=msg.queue_key,
    )
    if rt.definition.timeout is not None:
        # A durable timer like a sleep's: it survives restarts and owner changes, and
        # the run's end cancels it (``_finish`` cancels every pending timer).
        timeout_at = rt.now_ms() + round(rt.definition.timeout * 1000)
        rt._emit(WorkflowTimeoutSet, timeout_at_ms=timeout_at)
        rt._schedule(rt.state.entries[RUN_TIMEOUT_KEY], "timeout")
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


def on_terminate(rt: InstanceRuntime, msg: TerminateWorkflow) -> None:
    if rt.state.status.finished:
        rt._ignore(msg, f"instance is {rt.state.status.value}")
        return
    # At once: no compensation runs, running attempts are given up (not awaited), and
    # the children it still waits for are terminated too.
    rt._cancel_children(
        rt._waited_children(), f"its parent {rt.state.instance_id} was terminated", terminate=True
    )
    rt._finish(WorkflowTerminatedRecord, reason=clip_message(msg.reason))


def _on_run_timeout(rt: InstanceRuntime) -> None:
    """The run passed its ``@workflow(timeout=)``: it fails as a cancel would end it
    (children cancelled, attempts given up), with the error type ``WorkflowTimeout``."""
    limit = rt.definition.timeout if rt.definition is not None else None
    rt._cancel_children(rt._waited_children(), f"its parent {rt.state.instance_id} timed out")
    after = f" of {limit:g} s" if limit is not None else ""
    rt._fail_workflow(
        "WorkflowTimeout",
        f"instance {rt.state.instance_id} did not finish within its timeout{after} "
        "(@workflow(timeout=)); start it again, or raise the timeout",
    )


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
    if entry.key == RUN_TIMEOUT_KEY:
        _on_run_timeout(rt)
        return
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
        if intent is not None and intent.queued:
            return  # its code starts the next attempt once the queue admits it
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
    if rt.stale_attempts and (o.key, o.attempt) in rt.stale_attempts:
        # Given up when the previous run ended; a restart came before its outcome.
        rt.stale_attempts.discard((o.key, o.attempt))
        if entry is None or entry.state is not EntryState.RUNNING or entry.attempt != o.attempt:
            rt.inflight.discard((o.key, o.attempt))
        return
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
    TerminateWorkflow: on_terminate,
    PauseWorkflow: on_pause,
    ResumeWorkflow: on_resume,
    ResetWorkflow: on_reset,
    RetryWorkflow: on_reset,
    ForkWorkflow: on_fork,
    StartFork: on_start_fork,
}
