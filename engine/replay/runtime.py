"""The instance runtime: one workflow instance, its state, and its (cached) coroutine.

``handle`` takes one input (a command or a step outcome), decides the history records it
causes, folds them into the state, and drives the workflow code until it is blocked
again. It never performs I/O: step bodies to launch, timers to schedule and records to
append are returned in ``Output`` and only take effect after the processor made them
durable. If that commit fails, the processor drops the runtime and replays it later.

Replay: a runtime built from stored state starts a fresh coroutine; every ``ctx`` call
finds its replay key in the state and returns the recorded outcome at once, until the
code reaches the frontier. At the first quiet point every recorded entry must have been
visited, otherwise the code no longer matches the history (``HistoryDiverged``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepstream.engine.api.context import Context, current_scope
from stepstream.engine.api.retry import DEFAULT_RETRY, RetryPolicy
from stepstream.engine.api.workflow import WorkflowDefinition
from stepstream.engine.errors import (
    EventTimeout,
    Evicted,
    HistoryDiverged,
    InvalidPayload,
    InvalidWorkflowCall,
    PayloadTooLarge,
    StepFailed,
    StepstreamError,
)
from stepstream.engine.replay.loop import ROOT_TASK, WorkflowLoop
from stepstream.engine.replay.state import (
    Entry,
    EntryKind,
    EntryState,
    InstanceState,
    Status,
    child_command,
    child_event,
    loop_prefixes,
    message_command,
    parse_child_command,
    reply_key,
    split_timer_id,
)
from stepstream.engine.replay.state import timer_id as make_timer_id
from stepstream.engine.seams import Clock
from stepstream.engine.wire.codec import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PayloadCodec,
    check_size,
    clip_message,
    decode_safely,
    encode_safely,
)
from stepstream.engine.wire.names import event_name_problem, name_problem, step_name_problem
from stepstream.engine.wire.records import (
    CancelWorkflow,
    ChildStarted,
    Command,
    CommandIgnored,
    EventBuffered,
    HistoryRecord,
    LoopAdvanced,
    MessageCompleted,
    MessageSent,
    MessagesReceived,
    MessageWaitStarted,
    PauseWorkflow,
    Payload,
    RaceDecided,
    ResumeWorkflow,
    SendEvent,
    SleepElapsed,
    SleepStarted,
    StartWorkflow,
    StepAttemptStarted,
    TimerCancelled,
    TimerFired,
    TimerRecord,
    TimerScheduled,
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
from stepstream.engine.wire.records import StepFailed as StepFailedRecord
from stepstream.engine.wire.records import StepSucceeded as StepSucceededRecord

log = logging.getLogger("stepstream.engine")


# ``_forget_scope`` walks what the coroutine keeps once it holds at least this much.
_FORGET_AT_LEAST = 256


def _under(key: str, roots: set[str]) -> bool:
    """Whether ``key`` starts with one of ``roots`` followed by "/" or "." (it is a key
    of that scope, or of a task it ran)."""
    for index, char in enumerate(key):
        if (char == "/" or char == ".") and key[:index] in roots:
            return True
    return False


LOST_ATTEMPT = "AttemptLost"
# The purpose of the timer that decides an attempt found lost when an instance recovers.
LOST_PURPOSE = "lost"
PATCH_PREFIX = "~patch/"  # the replay keys of ctx.patched markers
CANCELLED_ATTEMPT = "AttemptCancelled"  # the step executor's error type for a cancel


# The purpose of an entry's timer, by the state that waits for it.
_TIMER_PURPOSES = {
    EntryState.BACKOFF: "retry",
    EntryState.SLEEPING: "sleep",
    EntryState.WAITING: "wait",
}


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """How one step attempt ended; produced by the step executor, never by a client."""

    instance_id: str
    key: str
    attempt: int
    result: Payload | None = None
    error_type: str = ""
    error_message: str = ""
    retryable: bool = True

    @property
    def command_id(self) -> str:
        return f"step:{self.instance_id}/{self.key}/{self.attempt}"


@dataclass(frozen=True, slots=True)
class StepLaunch:
    """A step attempt to run once the records announcing it are durable."""

    instance_id: str
    key: str
    attempt: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout: float | None
    workflow: str = ""  # for log lines about the attempt
    traceparent: str | None = None


@dataclass(slots=True)
class Output:
    """What handling inputs decided, to be committed as one batch."""

    history: list[HistoryRecord] = field(default_factory=list)
    timers: list[TimerRecord] = field(default_factory=list)
    launches: list[StepLaunch] = field(default_factory=list)
    # Running attempts to give up once this is durable: (instance id, key, attempt).
    cancels: list[tuple[str, str, int]] = field(default_factory=list)
    # Commands for other instances (children, parents), published with the records:
    # (the instance that decided it, the command).
    commands: list[tuple[str, Command]] = field(default_factory=list)
    # Answers to messages made durable by the commit (message id -> answer), for the
    # clients waiting in request(); filled when the state is written.
    replies: dict[str, Payload] = field(default_factory=dict)


@dataclass(slots=True)
class _StepIntent:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    policy: RetryPolicy
    timeout: float | None
    ephemeral: bool = False


class InstanceRuntime:
    def __init__(
        self,
        state: InstanceState,
        definition: WorkflowDefinition | None,
        *,
        codec: PayloadCodec,
        clock: Clock,
        epoch: int,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        self.state = state
        self.max_payload_bytes = max_payload_bytes
        self.definition = definition
        self.codec = codec
        self.clock = clock
        self.epoch = epoch
        self.inflight: set[tuple[str, int]] = set()
        # Whether the last input was recorded as ignored (CommandIgnored).
        self.ignored = False
        # Set while the partition is handed over: attempts that run may finish, but no
        # new one starts (the next owner replays and starts it, losing no attempt).
        self.draining = False
        self._intents: dict[str, _StepIntent] = {}
        self._loop: WorkflowLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._futures: dict[str, asyncio.Future[Any]] = {}
        self._visited: set[str] = set()
        self._counters: dict[str, int] = {}
        # Finished loop iterations' scopes ("<loop key>/<i>") not yet forgotten, and the
        # size of what the coroutine keeps at which they are (``_forget_scope``).
        self._forget_roots: set[str] = set()
        self._forget_at = _FORGET_AT_LEAST
        # (scope, name) -> uses so far in this run, and the task that used it last.
        self._names: dict[tuple[str, str], tuple[int, asyncio.Task[Any] | None]] = {}
        self._patches: dict[str, bool] = {}  # ctx.patched answers of this run
        # Ephemeral steps whose attempt runs with nothing recorded yet: key -> attempt.
        self._ephemeral: dict[str, int] = {}
        self._deferred: list[tuple[str, str]] = []
        self._replaying = False
        # Set while a drive may start retries whose backoff is over: on a resume (their
        # timers fired while paused) and on a retry's own timer. Otherwise a replay leaves
        # overdue timers to fire through the command log, after what is already there.
        self._retries_due = False
        # Set while recover() drives: an attempt lost with the previous owner is then not
        # decided at once but on a timer that fires now, through the command log, so
        # commands already there (a cancel sent while no worker ran) apply first.
        self._recovering = False
        # How long the last replay of the code took (seconds), until telemetry takes it.
        self.replayed_s: float | None = None
        self._closing = False  # set while close() unwinds the coroutine
        self._diverged: HistoryDiverged | None = None
        self._out: Output = Output()
        self._command_id = ""
        self._traceparent: str | None = None
        self._tracestate: str | None = None

    # ---- entry points ---------------------------------------------------------------

    def handle(self, msg: Command | StepOutcome, out: Output) -> None:
        self._out = out
        self.ignored = False
        self._command_id = msg.command_id
        # What this causes carries the trace of the command, else the run's (``_emit``).
        self._traceparent = self.state.traceparent
        self._tracestate = self.state.tracestate
        if isinstance(msg, Command):
            if msg.traceparent is not None:
                self._traceparent = msg.traceparent
                self._tracestate = msg.tracestate
            if msg.command_id in self.state.recent_commands:
                return  # already applied: a re-delivered command changes nothing
        match msg:
            case StepOutcome():
                self._on_outcome(msg)
            case TimerFired():
                self._on_timer(msg)
            case StartWorkflow():
                self._on_start(msg)
            case SendEvent():
                self._on_event(msg)
            case CancelWorkflow():
                self._on_cancel(msg)
            case PauseWorkflow():
                self._on_pause(msg)
            case ResumeWorkflow():
                self._on_resume(msg)
            case _:
                raise TypeError(f"unexpected input {type(msg).__name__}")

    def recover(self, out: Output) -> None:
        """Resume an instance loaded after a restart: replays its code, re-runs attempts
        that were in flight when the previous owner stopped, and publishes again the
        starts of children it still waits for (a start is idempotent; a finished child
        answers it with its outcome again). Sleeps, timeouts and retries that fell due
        meanwhile are not decided here: their durable timers fire through the command
        log, so commands already on it (a cancel sent while no worker ran) apply first."""
        self._out = out
        self._command_id = f"recover:{self.epoch}"
        self._traceparent = self.state.traceparent
        self._tracestate = self.state.tracestate
        for entry in self._waited_children():
            self._out.commands.append((self.state.instance_id, self._child_start(entry)))
        # A race's cancels of its losers' children are published with its records, which
        # a commit cut short may have kept without them (Kafka); a child applies one once.
        for race, child in self._children_of_lost_races():
            self._cancel_children([child], self._race_lost_reason(race))
        # Published with their records, which a commit cut short may have kept without
        # them (Kafka); the receiver applies a message's command id once.
        for entry in self.state.entries.values():
            if entry.kind is EntryKind.SENT:
                self._out.commands.append((self.state.instance_id, self._message(entry)))
        # Timers that fell due while no one ran the instance are armed again: a fire that
        # was dropped (a parked instance's retry, a retry an older version's drain held
        # back) would leave it waiting for ever; a second fire changes nothing.
        for entry in self.state.pending_timers():
            purpose = _TIMER_PURPOSES.get(entry.state)
            if purpose is not None and self._overdue(entry):
                self._schedule(entry, purpose)
        self._recovering = True
        try:
            self._drive()
        finally:
            self._recovering = False

    def _waited_children(self) -> list[Entry]:
        """Children whose outcome has not arrived yet."""
        entries = self.state.entries
        arrived = {b.name for b in self.state.buffered}
        return [
            e
            for e in entries.values()
            if e.kind is EntryKind.CHILD
            and child_event(e.key) not in arrived
            and (
                (result := entries.get(_child_result_key(e.key))) is None or not result.state.final
            )
        ]

    def _child_start(self, entry: Entry) -> StartWorkflow:
        assert entry.child_id is not None and entry.result is not None
        return StartWorkflow(
            instance_id=entry.child_id,
            command_id=child_command(self.state.instance_id, entry.key),
            time_ms=self.clock.now_ms(),
            workflow=entry.event_name or "",
            input=entry.result,
            traceparent=self._traceparent,
            tracestate=self._tracestate,
        )

    def _notify_parent(self) -> None:
        """A child that finished tells its parent how (an event only the parent's code
        waits for), with a command id that makes a repeated notice apply once."""
        state = self.state
        outcome: dict[str, Any] = {"status": state.status.value}
        if state.result is not None:
            try:
                outcome["result"] = decode_safely(self.codec, state.result)
            except StepstreamError as exc:
                outcome.update(status="failed", error_type="InvalidPayload", error=str(exc))
        if state.error_type:
            outcome.update(error_type=state.error_type, error=state.error_message)
        if state.cancel_reason:
            outcome["error"] = state.cancel_reason
        self._out.commands.append(
            (
                state.instance_id,
                SendEvent(
                    instance_id=state.parent_id,
                    command_id=f"childdone:{state.instance_id}",
                    time_ms=self.clock.now_ms(),
                    name=child_event(state.parent_key),
                    payload=encode_safely(self.codec, outcome),
                    traceparent=self._traceparent,
                    tracestate=self._tracestate,
                ),
            )
        )

    def _refuse_child(self, msg: StartWorkflow, parent_id: str, key: str) -> None:
        """A parent asked to start this instance as its child ``key``, but it exists
        already and is not that child (a client or another parent took the id): the
        parent's call fails at once rather than waiting for an outcome that is not its."""
        state = self.state
        outcome = {
            "status": "failed",
            "error_type": "InstanceExists",
            "error": (
                f"instance {state.instance_id} already exists (workflow {state.workflow}, "
                f"status {state.status.value}); start the child with an id of its own "
                "(instance_id=None names it after its parent)"
            ),
        }
        self._out.commands.append(
            (
                state.instance_id,
                SendEvent(
                    instance_id=parent_id,
                    # Its own id: the parent may meet this instance again under another key.
                    command_id=f"childexists:{msg.command_id}",
                    time_ms=self.clock.now_ms(),
                    name=child_event(key),
                    payload=encode_safely(self.codec, outcome),
                    traceparent=msg.traceparent,
                    tracestate=msg.tracestate,
                ),
            )
        )

    def _cancel_children(self, children: list[Entry], reason: str) -> None:
        for entry in children:
            assert entry.child_id is not None
            self._out.commands.append(
                (
                    self.state.instance_id,
                    CancelWorkflow(
                        instance_id=entry.child_id,
                        command_id=f"cancelchild:{entry.child_id}",
                        time_ms=self.clock.now_ms(),
                        reason=reason,
                    ),
                )
            )

    def start_child(self, key: str, workflow: str, input: Any, instance_id: str | None) -> str:
        """Record and publish the start of a child (once: replay returns its id)."""
        entry = self._visit(key, EntryKind.CHILD)
        if entry is not None:
            assert entry.child_id is not None
            return entry.child_id
        child_id = instance_id or f"{self.state.instance_id}/{key}"
        problem = name_problem(child_id) or name_problem(workflow)
        if problem is not None:
            raise InvalidWorkflowCall(f"child {key!r} of {self.state.instance_id}: {problem}")
        payload = check_size(
            encode_safely(self.codec, input),
            self.max_payload_bytes,
            what=f"the input of child {key!r} of instance {self.state.instance_id}",
        )
        self._emit(ChildStarted, key=key, workflow=workflow, child_id=child_id, input=payload)
        self._out.commands.append(
            (self.state.instance_id, self._child_start(self.state.entries[key]))
        )
        return child_id

    def child_result(self, key: str) -> asyncio.Future[Any]:
        """The child's outcome (a dict with its status, result or error), delivered as
        the event it sends when it finishes."""
        return self.wait_future(_child_result_key(key), child_event(key), None)

    # ---- what Context reads (engine.api.context.WorkflowRuntime) ---------------------------

    @property
    def instance_id(self) -> str:
        return self.state.instance_id

    @property
    def workflow(self) -> str:
        return self.state.workflow

    @property
    def version(self) -> str:
        return self.state.version

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def key_for(self, name: str) -> str:
        """The replay key of the next use of ``name`` in the current scope: the name
        itself the first time, ``name#n`` the nth time, prefixed with the scope."""
        if self._closing:
            raise Evicted(
                f"instance {self.state.instance_id} is being evicted: ctx calls in finally "
                "blocks record nothing (do not catch Evicted)"
            )
        problem = step_name_problem(name)
        if problem is not None:
            raise InvalidWorkflowCall(f"instance {self.state.instance_id}: name {problem}")
        scope = current_scope.get()
        task = asyncio.current_task() if self._loop is not None else None
        uses, last = self._names.get((scope, name), (0, None))
        if last is not None and task is not last and not last.done() and not _within(task, last):
            raise InvalidWorkflowCall(
                f"instance {self.state.instance_id}: name {scope + name!r} is used by two "
                "concurrent branches; which use came first could differ on replay. Give "
                "each branch its own scope (ctx.scope, ctx.join) or its own name"
            )
        uses += 1
        self._names[scope, name] = (uses, task)
        return f"{scope}{name}" if uses == 1 else f"{scope}{name}#{uses}"

    @property
    def diverged(self) -> HistoryDiverged | None:
        """How the code no longer matches the history, if it does not."""
        return self._diverged

    def park(self, reason: str) -> None:
        """Stop running the code (its history diverged): inputs are still recorded, and
        the state says why in ``parked`` (the status's ``error``)."""
        self.close()
        self.state.parked = reason

    @property
    def busy(self) -> bool:
        """True while a step attempt runs: such a runtime must stay cached."""
        return bool(self.inflight)

    def close(self) -> None:
        """Discard the coroutine (eviction, pause, a new owner): its tasks are cancelled
        and run until they unwound, so the workflow's ``finally:`` blocks and ``async
        with`` exits run now, not whenever the garbage collector gets to them. A ``ctx``
        call made while unwinding raises ``Evicted``: nothing is recorded."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            pending = loop.pending_tasks()
            if pending:
                self._closing = True
                try:
                    for task in pending:
                        task.cancel()
                    loop.run_until_quiet()
                except Exception:
                    log.exception("instance %s: unwinding the workflow failed", self.instance_id)
                finally:
                    self._closing = False
            loop.close()
        self._loop = None
        self._task = None
        self._futures.clear()

    # ---- record emission ------------------------------------------------------------

    def _emit(self, cls: type[HistoryRecord], **attrs: Any) -> HistoryRecord:
        state = self.state
        traceparent, tracestate = self._traceparent, self._tracestate
        if (
            traceparent is not None
            and traceparent == state.traceparent
            and tracestate == state.tracestate
            and cls is not WorkflowStarted
        ):
            # The run's own trace is stated once, on WorkflowStarted: a record carries
            # trace context only when what caused it came from another trace (an event
            # sent from elsewhere). Half the bytes of a traced run's records.
            traceparent = tracestate = None
        record = cls(
            instance_id=state.instance_id,
            seq=state.seq + 1,
            time_ms=self.clock.now_ms(),
            command_id=self._command_id,
            epoch=self.epoch,
            traceparent=traceparent,
            tracestate=tracestate,
            **attrs,
        )
        self.state.apply(record)
        self._out.history.append(record)
        return record

    def _timer(self, cls: type[TimerRecord], **attrs: Any) -> None:
        self._out.timers.append(
            cls(
                instance_id=self.state.instance_id,
                seq=self.state.seq,
                time_ms=self.clock.now_ms(),
                command_id=self._command_id,
                epoch=self.epoch,
                **attrs,
            )
        )

    def _schedule(self, entry: Entry, purpose: str) -> None:
        assert entry.timer_id is not None and entry.fire_at_ms is not None
        self._timer(
            TimerScheduled, timer_id=entry.timer_id, fire_at_ms=entry.fire_at_ms, purpose=purpose
        )

    def _ignore(self, msg: Command, reason: str) -> None:
        self.ignored = True
        self._emit(CommandIgnored, command_type=msg.type, reason=reason)

    # ---- commands -------------------------------------------------------------------

    def _on_start(self, msg: StartWorkflow) -> None:
        if self.state.workflow:
            self._ignore(msg, f"instance already exists (status {self.state.status.value})")
            asker = parse_child_command(msg.command_id)
            if asker is not None and asker != (self.state.parent_id, self.state.parent_key):
                self._refuse_child(msg, *asker)
            elif self.state.status.finished and self.state.parent_id:
                self._notify_parent()  # a parent's new owner asks again: answer again
            return
        assert self.definition is not None
        self._emit(
            WorkflowStarted,
            workflow=self.definition.name,
            version=self.definition.version,
            input=msg.input,
        )
        self._drive()

    def _on_event(self, msg: SendEvent) -> None:
        if self.state.status.finished:
            self._ignore(msg, f"instance is {self.state.status.value}")
            return
        waiting = self.state.waiting_for(msg.name)
        if not waiting or self.state.status is Status.PAUSED:
            # Held until a wait takes it (a paused instance takes nothing: on resume,
            # the waits take what arrived meanwhile, in order).
            self._emit(EventBuffered, event_name=msg.name, payload=msg.payload)
            return
        entry = min(waiting, key=lambda e: e.seq)
        if entry.names is not None:
            now = self.clock.now_ms()
            self._receive(entry, [(msg.command_id, msg.name, msg.payload, now)])
        else:
            self._satisfy(entry, msg.payload, msg.command_id)
        self._drive()

    def _receive(self, entry: Entry, messages: list[tuple[str, str, Payload, int]]) -> None:
        timer = entry.timer_id
        self._emit(
            MessagesReceived,
            key=entry.key,
            ids=[m[0] for m in messages],
            names=[m[1] for m in messages],
            content_types=[m[2].content_type for m in messages],
            data=[m[2].data for m in messages],
            sent_ms=[m[3] for m in messages],
        )
        if timer is not None:
            self._timer(TimerCancelled, timer_id=timer)
        self._resolve(entry)

    def _satisfy(self, entry: Entry, payload: Payload, event_command_id: str) -> None:
        timer = entry.timer_id
        self._emit(
            WaitSatisfied,
            key=entry.key,
            event_name=entry.event_name or "",
            payload=payload,
            event_command_id=event_command_id,
        )
        if timer is not None:
            self._timer(TimerCancelled, timer_id=timer)
        self._resolve(entry)

    def _on_cancel(self, msg: CancelWorkflow) -> None:
        if self.state.status.finished:
            self._ignore(msg, f"instance is {self.state.status.value}")
            return
        # Cancelling a parent cancels its children.
        self._cancel_children(
            self._waited_children(), f"its parent {self.state.instance_id} was cancelled"
        )
        self._finish(WorkflowCancelled, reason=clip_message(msg.reason))

    def _on_pause(self, msg: PauseWorkflow) -> None:
        if self.state.status.finished or self.state.status is Status.PAUSED:
            self._ignore(msg, f"instance is {self.state.status.value}")
            return
        self._emit(WorkflowPaused)
        # The coroutine is dropped; resume replays it from the recorded history.
        self.close()

    def _on_resume(self, msg: ResumeWorkflow) -> None:
        if self.state.status is not Status.PAUSED:
            self._ignore(msg, f"instance is {self.state.status.value}, not paused")
            return
        self._emit(WorkflowResumed)
        self._drive_with_retries_due()

    def _on_timer(self, msg: TimerFired) -> None:
        if self.state.status.finished:
            return
        entry = self.state.pending_timer(msg.timer_id)
        if entry is None:
            self._on_lost_timer(msg.timer_id)
            return  # cancelled, superseded or already fired: a duplicate fire is harmless
        if entry.fire_at_ms is not None and msg.fire_at_ms < entry.fire_at_ms:
            return  # a fire of an older schedule: the timer is not due yet
        if entry.state is EntryState.SLEEPING:
            self._emit(SleepElapsed, key=entry.key)
            self._resolve(entry)
        elif entry.state is EntryState.WAITING:
            self._emit(WaitTimedOut, key=entry.key)
            self._resolve(entry)
        elif entry.state is EntryState.BACKOFF:
            if self.state.status is Status.PAUSED:
                return  # resume replays and starts overdue retries
            intent = self._intents.get(entry.key)
            if self.draining:
                self._schedule(entry, "retry")  # armed again: it fires for the next owner
                return
            if intent is None or self._task is None:
                self._drive_with_retries_due()  # replay re-creates the intent and starts it
                return
            self._start_attempt(entry.key, intent, entry.attempt + 1)
        self._drive()

    def _on_lost_timer(self, fired: str) -> None:
        """The timer recover() set for an attempt lost with the previous owner: the loss
        is recorded now, and the next attempt starts (or the step fails for good)."""
        parts = split_timer_id(self.state.instance_id, fired)
        if parts is None or parts[0] != LOST_PURPOSE:
            return
        entry = self.state.entries.get(parts[1])
        if (
            entry is None
            or entry.state is not EntryState.RUNNING
            or fired != self._lost_timer_id(entry)  # a fire for an earlier attempt
            or (entry.key, entry.attempt) in self.inflight
        ):
            return  # its outcome came after all, or a duplicate fire
        if self.state.status is Status.PAUSED:
            return  # resume replays and decides the lost attempt
        if self._task is None:
            self._drive()  # the replay finds the attempt lost and decides it now
            return
        self._lose(entry)
        self._drive()

    def _lost_timer_id(self, entry: Entry) -> str:
        return make_timer_id(self.state.instance_id, LOST_PURPOSE, entry.key, entry.attempt)

    def _lose(self, entry: Entry) -> None:
        self._fail_attempt(
            entry,
            LOST_ATTEMPT,
            f"attempt {entry.attempt} was interrupted (worker stopped)",
            True,
            now=True,
        )

    def _on_outcome(self, o: StepOutcome) -> None:
        entry = self.state.entries.get(o.key)
        self.inflight.discard((o.key, o.attempt))
        if entry is None and self._ephemeral.get(o.key) == o.attempt:
            del self._ephemeral[o.key]
            if self.state.status.finished:
                return
            if o.result is None:
                # A failed ephemeral attempt is recorded like any other, and retried
                # durably from here on.
                intent = self._intents.get(o.key)
                if intent is None:
                    return
                self._record_attempt(o.key, intent, o.attempt)
                entry = self.state.entries[o.key]
            else:
                self._emit(StepSucceededRecord, key=o.key, attempt=o.attempt, result=o.result)
                self._resolve(self.state.entries[o.key])
                self._drive()
                return
        if (
            entry is None
            or entry.state is not EntryState.RUNNING
            or entry.attempt != o.attempt
            or self.state.status.finished
        ):
            return
        if o.result is not None:
            self._emit(StepSucceededRecord, key=o.key, attempt=o.attempt, result=o.result)
            self._resolve(entry)
        else:
            self._fail_attempt(entry, o.error_type, o.error_message, o.retryable)
        self._drive()

    def _fail_attempt(
        self, entry: Entry, error_type: str, message: str, retryable: bool, *, now: bool = False
    ) -> None:
        intent = self._intents.get(entry.key)
        policy = intent.policy if intent is not None else DEFAULT_RETRY
        retry = retryable and (entry.max_attempts == 0 or entry.attempt < entry.max_attempts)
        next_at = None
        if retry:
            next_at = self.clock.now_ms() + (0 if now else policy.delay_ms(entry.attempt))
        self._emit(
            StepFailedRecord,
            key=entry.key,
            attempt=entry.attempt,
            error_type=error_type,
            error_message=clip_message(message),
            next_attempt_at_ms=next_at,
        )
        if not retry:
            self._resolve(entry)
        elif now and intent is not None and not self.draining:
            self._start_attempt(entry.key, intent, entry.attempt + 1)
        else:
            self._schedule(entry, "retry")  # draining: the next owner finds it overdue

    # ---- driving the code -----------------------------------------------------------

    def _runnable(self) -> bool:
        return (
            # Parked (its history no longer matches the code, or its version is not
            # deployed): inputs are recorded, the code is not run, until a worker with
            # matching code loads it again (which clears ``parked``).
            not self.state.parked
            and self.definition is not None
            and self.state.status
            in (
                Status.PENDING,
                Status.RUNNING,
            )
        )

    def _begin(self) -> None:
        assert self.definition is not None and self.state.input is not None
        self._loop = WorkflowLoop(  # type: ignore[abstract]
            f"{self.state.workflow}/{self.state.instance_id}"
        )
        self._futures = {}
        self._visited = set()
        self._counters = {}
        self._forget_roots = set()
        self._forget_at = _FORGET_AT_LEAST
        self._names = {}
        self._patches = {}
        self._deferred = []
        self._diverged = None
        self._replaying = bool(self.state.entries)
        try:
            arg = decode_safely(self.codec, self.state.input)
        except StepstreamError as exc:
            self._fail_workflow("InvalidPayload", f"cannot decode workflow input: {exc}")
            return
        coro = self.definition.fn(Context(self), arg)
        self._task = self._loop.create_task(coro)  # type: ignore[arg-type]

    def _drive_with_retries_due(self) -> None:
        self._retries_due = True
        try:
            self._drive()
        finally:
            self._retries_due = False

    def _drive(self) -> None:
        if not self._runnable():
            return
        if self._task is None:
            self._begin()
            if self._task is None:
                return
        assert self._loop is not None
        while True:
            # Measured for metrics only; nothing the replay decides depends on it.
            began = time.perf_counter() if self._replaying else 0.0
            self._loop.run_until_quiet()
            if self._replaying:
                self._replaying = False
                self.replayed_s = time.perf_counter() - began
                self._check_all_visited()
            if self._diverged is not None:
                # The owner parks the instance: nothing this drive decided is kept.
                raise self._diverged
            if self._task.done():
                self._complete()
                return
            if not self._deferred:
                return
            deferred, self._deferred = self._deferred, []
            for what, key in deferred:
                self._act(what, key)

    def _check_all_visited(self) -> None:
        # What losing race branches recorded is not replayed (only the winner runs), nor
        # are the loop iterations before the one a loop resumes at.
        lost = tuple(
            prefix
            for e in self.state.entries.values()
            if e.key in self._visited
            for prefix in _not_replayed(e)
        )
        missed = sorted(
            (
                e
                for e in self.state.entries.values()
                if e.key not in self._visited
                and not (lost and e.key.startswith(lost))
                and not e.key.startswith(PATCH_PREFIX)  # a patch the code has dropped
            ),
            key=lambda e: e.seq,
        )
        if missed and self._diverged is None:
            first = missed[0]
            self._diverged = HistoryDiverged(
                f"instance {self.state.instance_id}: history has {first.kind.value} "
                f"{first.key!r} (recorded at seq {first.seq}) but the code no longer reaches "
                "it; deploy the code that started this instance, or register the change "
                "as a new workflow version",
                key=first.key,
            )

    def _act(self, what: str, key: str) -> None:
        entry = self.state.entries.get(key)
        if what == "step":
            intent = self._intents[key]
            if self.draining and entry is None:
                return  # held: the next owner's replay starts it
            if self.draining and entry is not None and entry.state is EntryState.BACKOFF:
                self._schedule(entry, "retry")  # held: armed again, it fires for the next owner
                return
            if entry is None:
                self._start_attempt(key, intent, 1)
            elif entry.state is EntryState.RUNNING:  # attempt lost with the previous owner
                if self._recovering:
                    self._timer(
                        TimerScheduled,
                        timer_id=self._lost_timer_id(entry),
                        fire_at_ms=self.clock.now_ms(),
                        purpose=LOST_PURPOSE,
                    )
                else:
                    self._lose(entry)
            elif entry.state is EntryState.BACKOFF:
                self._start_attempt(key, intent, entry.attempt + 1)
        elif what == "sleep":
            assert entry is not None and entry.fire_at_ms is not None
            if entry.state is EntryState.SLEEPING:
                if entry.fire_at_ms <= self.clock.now_ms():
                    self._emit(SleepElapsed, key=key)
                    self._resolve(entry)
                else:
                    self._schedule(entry, "sleep")
        elif what == "messages":
            assert entry is not None and entry.state is EntryState.WAITING
            names = entry.names or []
            # The oldest of these names, at most max_attempts: stop once found.
            taken = list(
                itertools.islice(
                    (b for b in self.state.buffered if b.name in names), entry.max_attempts
                )
            )
            if taken:
                self._receive(entry, [(b.command_id, b.name, b.payload, b.time_ms) for b in taken])
            elif entry.timer_id is not None:
                self._schedule(entry, "wait")
        elif what == "wait":
            assert entry is not None and entry.state is EntryState.WAITING
            buffered = next((b for b in self.state.buffered if b.name == entry.event_name), None)
            if buffered is not None:
                self._satisfy(entry, buffered.payload, buffered.command_id)
            elif entry.timer_id is not None:
                self._schedule(entry, "wait")

    def _start_attempt(self, key: str, intent: _StepIntent, attempt: int) -> None:
        if intent.ephemeral and key not in self.state.entries:
            # Nothing recorded before the body runs: its result is recorded with the
            # records it comes back to; after a crash before that, it runs again.
            self._ephemeral[key] = attempt
        else:
            self._record_attempt(key, intent, attempt)
        self.inflight.add((key, attempt))
        self._out.launches.append(
            StepLaunch(
                self.state.instance_id,
                key,
                attempt,
                intent.fn,
                intent.args,
                intent.kwargs,
                intent.timeout,
                self.state.workflow,
                self.state.traceparent,
            )
        )

    def _record_attempt(self, key: str, intent: _StepIntent, attempt: int) -> None:
        deadline = (
            None if intent.timeout is None else self.clock.now_ms() + int(intent.timeout * 1000)
        )
        self._emit(
            StepAttemptStarted,
            key=key,
            attempt=attempt,
            max_attempts=intent.policy.max_attempts or 0,
            deadline_ms=deadline,
        )

    def _complete(self) -> None:
        assert self._task is not None
        if self._task.cancelled():
            self._fail_workflow("Cancelled", "the workflow's main task was cancelled")
            return
        exc = self._task.exception()
        if exc is not None:
            self._fail_workflow(type(exc).__name__, str(exc) or repr(exc))
            return
        try:
            result = check_size(
                encode_safely(self.codec, self._task.result()),
                self.max_payload_bytes,
                what=f"the result of instance {self.state.instance_id}",
            )
        except (InvalidPayload, PayloadTooLarge) as err:
            self._fail_workflow(type(err).__name__, f"workflow result: {err}")
            return
        self._finish(WorkflowCompleted, result=result)

    def _fail_workflow(self, error_type: str, message: str) -> None:
        self._finish(WorkflowFailed, error_type=error_type, error_message=clip_message(message))

    def _finish(self, cls: type[HistoryRecord], **attrs: Any) -> None:
        for entry in self.state.pending_timers():
            assert entry.timer_id is not None
            self._timer(TimerCancelled, timer_id=entry.timer_id)
        self._give_up_attempts(self.state.open_entries())
        self._emit(cls, **attrs)
        if self.state.parent_id:
            self._notify_parent()
        self.close()

    # ---- futures the code awaits ----------------------------------------------------

    def _visit(self, key: str, kind: EntryKind) -> Entry | None:
        # Keys are unique by construction (key_for counts uses), values' by their task.
        assert key not in self._visited, key
        self._visited.add(key)
        entry = self.state.entries.get(key)
        if entry is not None and entry.kind is not kind:
            err = HistoryDiverged(
                f"instance {self.state.instance_id}: history has {entry.kind.value} {key!r} "
                f"where the code now has a {kind.value}; deploy the code that started this "
                "instance, or register the change as a new workflow version",
                key=key,
            )
            self._diverged = self._diverged or err
            raise err
        return entry

    def _future(self, entry: Entry | None, key: str) -> asyncio.Future[Any]:
        assert self._loop is not None
        fut = self._loop.create_future()
        self._futures[key] = fut
        if entry is not None and entry.state.final:
            self._settle(fut, entry)
        return fut

    def _resolve(self, entry: Entry) -> None:
        fut = self._futures.get(entry.key)
        if fut is not None and not fut.done():
            self._settle(fut, entry)

    def _settle(self, fut: asyncio.Future[Any], entry: Entry) -> None:
        if entry.names is not None and entry.state is EntryState.SATISFIED:
            fut.set_result(list(entry.messages or ()))  # raw: decoded where they are used
            return
        match entry.state:
            case EntryState.SUCCEEDED | EntryState.SATISFIED | EntryState.RECORDED:
                assert entry.result is not None
                try:
                    fut.set_result(decode_safely(self.codec, entry.result))
                except StepstreamError as exc:
                    fut.set_exception(exc)
            case EntryState.FAILED:
                fut.set_exception(
                    StepFailed(
                        f"step {entry.key!r} of instance {self.state.instance_id} failed after "
                        f"{entry.attempt} attempt(s): {entry.error_type}: {entry.error_message}",
                        key=entry.key,
                        attempts=entry.attempt,
                        error_type=entry.error_type,
                        error_message=entry.error_message,
                        kind=_failure_kind(entry),
                    )
                )
            case EntryState.ELAPSED:
                fut.set_result(None)
            case EntryState.TIMED_OUT:
                fut.set_exception(
                    EventTimeout(
                        f"instance {self.state.instance_id}: no event {entry.event_name!r} "
                        f"arrived before the timeout of wait {entry.key!r}",
                        key=entry.key,
                        event_name=entry.event_name or "",
                    )
                )
            case _:
                pass

    def step_future(
        self,
        key: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retry: RetryPolicy | None,
        timeout: float | None,
        ephemeral: bool = False,
    ) -> asyncio.Future[Any]:
        if not callable(fn):
            raise TypeError(f"ctx.step({key!r}, ...): {fn!r} is not callable")
        entry = self._visit(key, EntryKind.STEP)
        self._intents[key] = _StepIntent(
            fn, args, kwargs, retry or DEFAULT_RETRY, timeout, ephemeral
        )
        fut = self._future(entry, key)
        if (entry is None and key not in self._ephemeral) or (
            entry is not None
            and entry.state in (EntryState.RUNNING, EntryState.BACKOFF)
            and (key, entry.attempt) not in self.inflight
            and (entry.state is EntryState.RUNNING or (self._retries_due and self._overdue(entry)))
        ):
            self._deferred.append(("step", key))
        return fut

    def _overdue(self, entry: Entry) -> bool:
        return entry.fire_at_ms is not None and entry.fire_at_ms <= self.clock.now_ms()

    def sleep_future(
        self, key: str, *, delay_ms: int | None = None, wake_at_ms: int | None = None
    ) -> asyncio.Future[Any]:
        entry = self._visit(key, EntryKind.SLEEP)
        if entry is None:
            wake = wake_at_ms if wake_at_ms is not None else self.clock.now_ms() + (delay_ms or 0)
            self._emit(SleepStarted, key=key, wake_at_ms=wake)
            self._deferred.append(("sleep", key))
        # An overdue sleep found on replay is left to its timer, whose fire comes through
        # the command log: commands already there (a cancel) apply first.
        return self._future(entry, key)

    def wait_future(self, key: str, event_name: str, timeout_ms: int | None) -> asyncio.Future[Any]:
        entry = self._visit(key, EntryKind.WAIT)
        if entry is None:
            timeout_at = None if timeout_ms is None else self.clock.now_ms() + timeout_ms
            self._emit(WaitStarted, key=key, event_name=event_name, timeout_at_ms=timeout_at)
            self._deferred.append(("wait", key))
        elif entry.state is EntryState.WAITING:  # an overdue timeout is left to its timer
            if any(b.name == event_name for b in self.state.buffered):
                self._deferred.append(("wait", key))
        return self._future(self.state.entries.get(key), key)

    def loop_resume(self, key: str, initial: Any) -> tuple[int, Any]:
        """Where the loop ``key`` starts: its last recorded iteration and state, or 0 and
        ``initial`` the first time."""
        entry = self._visit(key, EntryKind.LOOP)
        if entry is None:
            return 0, initial
        assert entry.result is not None
        return entry.attempt, decode_safely(self.codec, entry.result)

    def loop_advanced(self, key: str, iteration: int, state: Any, keep: int) -> Any:
        """Record that the loop goes on with ``iteration`` and ``state``; returns the
        state as replay will see it (decoded from what was recorded)."""
        payload = check_size(
            encode_safely(self.codec, state),
            self.max_payload_bytes,
            what=f"the state of loop {key!r} of instance {self.state.instance_id}",
        )
        self._emit(LoopAdvanced, key=key, iteration=iteration, state=payload, keep=keep)
        self._forget_scope(loop_prefixes(key, iteration - 1))
        return decode_safely(self.codec, payload)

    def _forget_scope(self, prefixes: tuple[str, ...]) -> None:
        """Drop what the live coroutine kept about a finished loop iteration (its keys
        are never used again), so an endless loop runs in bounded memory.

        In batches: once what it keeps has doubled since the last batch, one walk drops
        every finished iteration's keys. A walk per iteration would cost each iteration
        as much as every key the instance holds (its steps before the loop included)."""
        for prefix in prefixes:
            assert prefix[-1:] in ("/", "."), prefix  # a scope's, or its tasks'
            self._forget_roots.add(prefix[:-1])
        if self._kept() < self._forget_at:
            return
        roots, self._forget_roots = self._forget_roots, set()

        def gone(key: str) -> bool:
            return _under(key, roots)

        for key in [k for k in self._futures if gone(k)]:
            del self._futures[key]
        for key in [k for k in self._intents if gone(k)]:
            if not any(k == key for k, _ in self.inflight):
                del self._intents[key]
        self._visited.difference_update([k for k in self._visited if gone(k)])
        for slot in [s for s in self._names if gone(s[0])]:
            del self._names[slot]
        for counter in [c for c in self._counters if gone(c)]:
            del self._counters[counter]
        if self._loop is not None:
            self._loop.forget_tasks(gone)
        self._forget_at = max(_FORGET_AT_LEAST, 2 * self._kept())

    def _kept(self) -> int:
        """How much the coroutine keeps about the keys it used."""
        return (
            len(self._futures)
            + len(self._intents)
            + len(self._visited)
            + len(self._names)
            + len(self._counters)
        )

    def race_decided(self, key: str) -> tuple[str, list[str]] | None:
        """The recorded winner and losers of the race ``key``, or None if it is open."""
        entry = self._visit(key, EntryKind.RACE)
        if entry is None:
            return None
        assert entry.winner is not None
        return entry.winner, list(entry.losers or ())

    def decide_race(self, key: str, winner: str, losers: list[str]) -> None:
        """Record the winner; abandon what the losing branches (scope prefixes) were
        doing: their timers are cancelled and their running attempts given up."""
        prefixes = tuple(losers)
        abandoned = [e for e in self.state.under(prefixes) if not e.state.final]
        for entry in abandoned:
            if entry.timer_id is not None:
                self._timer(TimerCancelled, timer_id=entry.timer_id)
        self._give_up_attempts(abandoned, prefixes)
        # Taken before the record, which withdraws the losers' waits (their children's too).
        children = [e for e in self._waited_children() if e.key.startswith(prefixes)]
        self._emit(RaceDecided, key=key, winner=winner, losers=losers)
        self._cancel_children(children, self._race_lost_reason(key))

    def _race_lost_reason(self, key: str) -> str:
        return f"it was started in a losing branch of race {key!r} of {self.state.instance_id}"

    def _children_of_lost_races(self) -> list[tuple[str, Entry]]:
        """(race key, child) for the children started in the losing branches of decided
        races whose outcome has not arrived."""
        entries = self.state.entries
        races = [
            (e.key, tuple(e.losers))
            for e in entries.values()
            if e.kind is EntryKind.RACE and e.losers
        ]
        if not races:
            return []
        # The race withdrew the losers' waits, so an outcome that came after it was buffered.
        arrived = {b.name for b in self.state.buffered}
        running = [
            e
            for e in entries.values()
            if e.kind is EntryKind.CHILD
            and child_event(e.key) not in arrived
            and (
                (result := entries.get(_child_result_key(e.key))) is None
                or result.state is EntryState.ABANDONED
            )
        ]
        return [(key, c) for key, losers in races for c in running if c.key.startswith(losers)]

    def _give_up_attempts(self, entries: list[Entry], prefixes: tuple[str, ...] = ("",)) -> None:
        """Give up the running attempts of ``entries``, and of ephemeral steps whose keys
        start with one of ``prefixes`` (nothing recorded of those: just forgotten)."""
        for key, attempt in list(self._ephemeral.items()):
            if key.startswith(prefixes):
                del self._ephemeral[key]
                self._out.cancels.append((self.state.instance_id, key, attempt))
        for entry in entries:
            if entry.state is EntryState.RUNNING and (entry.key, entry.attempt) in self.inflight:
                self._out.cancels.append((self.state.instance_id, entry.key, entry.attempt))

    def message_future(
        self, key: str, names: list[str], max_messages: int, timeout_ms: int | None
    ) -> asyncio.Future[Any]:
        """Up to ``max_messages`` messages of any of ``names`` (at least one), as raw
        (id, name, payload, arrived at ms) tuples; ``EventTimeout`` after the timeout."""
        entry = self._visit(key, EntryKind.WAIT)
        if entry is None:
            timeout_at = None if timeout_ms is None else self.clock.now_ms() + timeout_ms
            self._emit(
                MessageWaitStarted,
                key=key,
                names=names,
                max=max_messages,
                timeout_at_ms=timeout_at,
            )
            self._deferred.append(("messages", key))
        elif entry.state is EntryState.WAITING:  # an overdue timeout is left to its timer
            if any(b.name in names for b in self.state.buffered):
                self._deferred.append(("messages", key))
        return self._future(self.state.entries.get(key), key)

    def send_message(self, key: str, target: str, name: str, payload: Any) -> None:
        """Record a message for another instance and publish it (once: replay sends
        nothing, and the receiver applies a repeat of its command id once)."""
        if self._visit(key, EntryKind.SENT) is not None:
            return
        problem = name_problem(target) or event_name_problem(name)
        if problem is not None:
            raise InvalidWorkflowCall(f"message {key!r} of {self.state.instance_id}: {problem}")
        encoded = check_size(
            encode_safely(self.codec, payload),
            self.max_payload_bytes,
            what=f"message {name!r} from instance {self.state.instance_id}",
        )
        self._emit(MessageSent, key=key, target=target, name=name, payload=encoded)
        self._out.commands.append((self.state.instance_id, self._message(self.state.entries[key])))

    def _message(self, entry: Entry) -> SendEvent:
        assert entry.child_id is not None and entry.result is not None
        return SendEvent(
            instance_id=entry.child_id,
            command_id=message_command(self.state.instance_id, entry.key),
            time_ms=self.clock.now_ms(),
            name=entry.event_name or "",
            payload=entry.result,
            traceparent=self._traceparent,
            tracestate=self._tracestate,
        )

    def complete_message(self, message_id: str, value: Any) -> None:
        """Answer a message (a client's request() gets ``value``); once per message."""
        if self._visit(reply_key(message_id), EntryKind.VALUE) is not None:
            return
        result = check_size(
            encode_safely(self.codec, value),
            self.max_payload_bytes,
            what=f"the answer to message {message_id} of instance {self.state.instance_id}",
        )
        self._emit(MessageCompleted, message_id=message_id, result=result)

    def patched(self, patch_id: str) -> bool:
        """True where code with the patch first reaches this point (recorded, so replay
        says True again); False while replaying a history recorded before the patch (it
        goes on past this point without a record of it). One answer per id and run."""
        problem = step_name_problem(patch_id)
        if problem is not None:
            raise InvalidWorkflowCall(f"instance {self.state.instance_id}: patch id {problem}")
        key = f"{PATCH_PREFIX}{patch_id}"
        known = self._patches.get(key)
        if known is not None:
            return known
        if key in self.state.entries:
            self._visited.add(key)
            answer = True
        elif self._replaying and self._history_goes_on():
            answer = False  # this history was made by code without the patch
        else:
            marker = encode_safely(self.codec, True)
            self._emit(ValueRecorded, key=key, kind="patch", value=marker)
            self._visited.add(key)
            answer = True
        self._patches[key] = answer
        return answer

    def removed(self, key: str) -> None:
        """Code no longer has the step, sleep or wait ``key``: an older history's entry
        for it counts as reached (its attempt, if one still runs, is given up)."""
        entry = self.state.entries.get(key)
        if entry is None or key in self._visited:
            return
        self._visited.add(key)
        if entry.timer_id is not None and not entry.state.final:
            self._timer(TimerCancelled, timer_id=entry.timer_id)
        self._give_up_attempts([entry])

    def _history_goes_on(self) -> bool:
        """Whether recorded entries remain that replay has not reached yet."""
        return any(
            key not in self._visited and not key.startswith(PATCH_PREFIX)
            for key in self.state.entries
        )

    def record_value(self, kind: str, produce: Callable[[], Any]) -> Any:
        if self._closing:
            raise Evicted(f"instance {self.state.instance_id} is being evicted")
        # Values have no name, so their key is the task that read them plus a count;
        # parallel branches may run in another order on replay but keep their paths.
        path = WorkflowLoop.task_path()
        scope = f"{kind}#" if path == ROOT_TASK else f"{path}/{kind}#"
        n = self._counters.get(scope, 0) + 1
        self._counters[scope] = n
        key = f"{scope}{n}"
        entry = self._visit(key, EntryKind.VALUE)
        if entry is not None:
            assert entry.result is not None
            return decode_safely(self.codec, entry.result)
        value = produce()
        self._emit(ValueRecorded, key=key, kind=kind, value=encode_safely(self.codec, value))
        return value


def _within(task: asyncio.Task[Any] | None, ancestor: asyncio.Task[Any]) -> bool:
    """Whether ``task`` was created (directly or not) by ``ancestor``: the workflow loop
    names tasks by their path from the root task."""
    if task is None:
        return False
    root = ancestor.get_name()
    return task.get_name().startswith(root + ".") or root == ROOT_TASK


def _failure_kind(entry: Entry) -> str:
    if entry.error_type == CANCELLED_ATTEMPT:
        return "cancelled"
    if entry.error_type == "StepTimeout":
        return "timeout"
    # A body's NonRetryableError ends the step at whichever attempt raised it: at the last
    # one (an earlier attempt was lost to a crash, say) the count alone would read
    # "exhausted". (A subclass is recorded by its own name: there only the count tells.)
    if entry.error_type == "NonRetryableError" or (
        entry.max_attempts and entry.attempt < entry.max_attempts
    ):
        return "non_retryable"
    return "exhausted"


def _not_replayed(entry: Entry) -> list[str]:
    """Key prefixes under ``entry`` that replay does not reach."""
    if entry.kind is EntryKind.RACE:
        return list(entry.losers or ())
    if entry.kind is EntryKind.LOOP:
        kept = range(entry.max_attempts, entry.attempt)
        return [p for j in kept for p in loop_prefixes(entry.key, j)]
    return []


def _child_result_key(key: str) -> str:
    return f"{key}/result"
