"""Driving an instance's workflow code: run it until it blocks, check that a replay
reached every recorded entry, act on the steps, sleeps and waits it asked for, and
record how the run ended."""

from __future__ import annotations

import itertools
import time
from typing import Any

from stepstream.engine.api.context import Context
from stepstream.engine.api.queues import queued_run
from stepstream.engine.api.retry import DEFAULT_RETRY
from stepstream.engine.errors import (
    HistoryDiverged,
    InvalidPayload,
    PayloadTooLarge,
    StepstreamError,
)
from stepstream.engine.replay.admission import AdmissionMixin
from stepstream.engine.replay.core import WORKFLOW_TRACEBACK
from stepstream.engine.replay.effects import (
    FORGET_AT_LEAST,
    LOST_ATTEMPT,
    LOST_PURPOSE,
    PATCH_PREFIX,
    Phase,
    StepIntent,
    StepLaunch,
)
from stepstream.engine.replay.ids import RUN_TIMEOUT_KEY, loop_prefixes
from stepstream.engine.replay.ids import timer_id as make_timer_id
from stepstream.engine.replay.loop import WorkflowLoop
from stepstream.engine.replay.outgoing import OutgoingMixin
from stepstream.engine.replay.state import Entry, EntryKind, EntryState, Status
from stepstream.engine.wire.codec import (
    check_size,
    clip_message,
    decode_safely,
    encode_safely,
    error_message,
    format_traceback,
)
from stepstream.engine.wire.records import (
    HistoryRecord,
    MessagesReceived,
    Payload,
    SleepElapsed,
    StepAttemptStarted,
    StepFailedRecord,
    TimerCancelled,
    TimerScheduled,
    WaitSatisfied,
    WorkflowCompleted,
    WorkflowFailedRecord,
)


class DrivingMixin(OutgoingMixin, AdmissionMixin):
    """Running the workflow code until it blocks, and acting on what it asked for:
    attempts to start, sleeps and waits to arm, the end of the run."""

    def _context(self) -> Context:
        """The ``Context`` the code gets: the whole runtime behind it (``InstanceRuntime``)."""
        raise NotImplementedError

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
        self._forget_at = FORGET_AT_LEAST
        self._names = {}
        self._repeats = {}
        self._patches = {}
        self._lost_tasks = []
        self._deferred = []
        self._diverged = None
        self._replaying = any(key != RUN_TIMEOUT_KEY for key in self.state.entries)
        try:
            arg = decode_safely(self.codec, self.state.input)
        except StepstreamError as exc:
            message = f"cannot decode workflow input: {exc}"
            if self._replaying:
                # It ran, so a codec read this input: what changed is this engine's codec
                # (another one, a key dropped). Failing it would lose the instance;
                # parked, it goes on once an engine with a codec that reads it loads it.
                self.park(f"InvalidPayload: {message}; restart with the codec that wrote it")
                return
            self._fail_workflow("InvalidPayload", message)
            return
        queue = self.definition.queue
        if queue is None:
            coro = self.definition.fn(self._context(), arg)
        else:
            priority, queue_key = self.state.queue_request
            coro = queued_run(self._context(), queue, self.definition.fn, arg, priority, queue_key)
        self._task = self._loop.create_task(coro)  # type: ignore[arg-type]

    def _drive_with_retries_due(self) -> None:
        previous, self._phase = self._phase, Phase.RETRIES_DUE
        try:
            self._drive()
        finally:
            self._phase = previous

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
        if self._asking_again():
            return  # what the code recorded past that wait, it reaches once admitted
        # What losing race branches recorded is not replayed (only the winner runs), nor
        # are the loop iterations before the one a loop resumes at.
        lost = tuple(
            prefix
            for e in self.state.entries.values()
            if e.key in self._visited
            for prefix in _not_replayed(e)
        ) + tuple(f"{path}{sep}" for path in self._lost_tasks for sep in "/.")
        missed = sorted(
            (
                e
                for e in self.state.entries.values()
                if e.key not in self._visited
                and not (lost and e.key.startswith(lost))
                and not e.key.startswith(PATCH_PREFIX)  # a patch the code has dropped
                and e.key != RUN_TIMEOUT_KEY  # the run's time limit: no code visits it
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
                if self._phase is Phase.RECOVERING:
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
                    # Due already (one that counts from when the start was taken may be,
                    # if the start waited longer): the code waited, so the workflow's
                    # time moves on to the engine's, past this sleep's end.
                    self.clock_from_ms = None
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

    def _start_attempt(self, key: str, intent: StepIntent, attempt: int) -> None:
        # When a retry became due, read before the attempt's record clears it: when its
        # backoff ended. A first attempt is due as the batch deciding it began (0).
        due_ms = 0
        if attempt > 1:
            entry = self.state.entries.get(key)
            if entry is not None and entry.fire_at_ms is not None:
                due_ms = entry.fire_at_ms
        floors = self.state.attempt_floors
        if floors:  # above every attempt a reset set aside (``engine.replay.reset``)
            attempt = max(attempt, floors.get(key, 0) + 1)
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
                self.state.created_ms,
                due_ms=due_ms,
            )
        )

    def _record_attempt(self, key: str, intent: StepIntent, attempt: int) -> None:
        deadline = (
            None if intent.timeout is None else self.clock.now_ms() + int(intent.timeout * 1000)
        )
        self._emit(
            StepAttemptStarted,
            key=key,
            attempt=attempt,
            # A reset gives the step a fresh budget above the attempts it set aside.
            max_attempts=(
                intent.policy.max_attempts + self.state.attempt_floors.get(key, 0)
                if intent.policy.max_attempts and self.state.attempt_floors
                else intent.policy.max_attempts or 0
            ),
            deadline_ms=deadline,
        )

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

    def _fail_attempt(
        self,
        entry: Entry,
        error_type: str,
        message: str,
        retryable: bool,
        *,
        now: bool = False,
        traceback: str | None = None,
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
            traceback=traceback,
        )
        if traceback:
            self.tracebacks[(entry.key, entry.attempt)] = traceback
        if not retry:
            self._resolve(entry)
        elif intent is not None and intent.queued:
            self._backed_off(entry)  # the code starts the next attempt once admitted
        elif now and intent is not None and not self.draining:
            self._start_attempt(entry.key, intent, entry.attempt + 1)
        else:
            self._schedule(entry, "retry")  # draining: the next owner finds it overdue

    def _complete(self) -> None:
        assert self._task is not None
        if self._task.cancelled():
            self._fail_workflow("Cancelled", "the workflow's main task was cancelled")
            return
        exc = self._task.exception()
        if exc is not None:
            trace = format_traceback(exc)
            self.tracebacks[WORKFLOW_TRACEBACK] = trace
            self._fail_workflow(type(exc).__name__, error_message(exc), trace)
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

    def _fail_workflow(self, error_type: str, message: str, trace: str | None = None) -> None:
        self._finish(
            WorkflowFailedRecord,
            error_type=error_type,
            error_message=clip_message(message),
            traceback=trace,
        )

    def _finish(self, cls: type[HistoryRecord], **attrs: Any) -> None:
        for entry in self.state.pending_timers():
            assert entry.timer_id is not None
            self._timer(TimerCancelled, timer_id=entry.timer_id)
        self._give_up_attempts(self.state.open_entries())
        self._withdraw_from_queues()
        self._emit(cls, **attrs)
        if self.state.parent_id:
            self._notify_parent()
        self.close()


def _not_replayed(entry: Entry) -> list[str]:
    """Key prefixes under ``entry`` that replay does not reach."""
    if entry.kind is EntryKind.RACE:
        return list(entry.losers or ())
    if entry.kind is EntryKind.LOOP:
        kept = range(entry.max_attempts, entry.attempt)
        return [p for j in kept for p in loop_prefixes(entry.key, j)]
    return []
