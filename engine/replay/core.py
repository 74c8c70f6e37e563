"""The core of an instance runtime: its state, record emission, the futures its
code awaits, and closing the coroutine. The other parts of ``InstanceRuntime`` build on it."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from stepstream.engine.api.workflow import WorkflowDefinition
from stepstream.engine.errors import (
    EventTimeout,
    HistoryDiverged,
    RecordedPayloadUnreadable,
    StepFailed,
    StepstreamError,
)
from stepstream.engine.replay.effects import (
    CANCELLED_ATTEMPT,
    FORGET_AT_LEAST,
    Output,
    Phase,
    StepIntent,
)
from stepstream.engine.replay.loop import WorkflowLoop

if TYPE_CHECKING:
    from stepstream.engine.replay.reset import HistoryAccess
from stepstream.engine.replay.state import Entry, EntryKind, EntryState, InstanceState
from stepstream.engine.seams import Clock
from stepstream.engine.wire.codec import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    PayloadCodec,
    decode_safely,
)
from stepstream.engine.wire.records import (
    Command,
    CommandIgnored,
    HistoryRecord,
    Payload,
    TimerRecord,
    TimerScheduled,
    WorkflowStarted,
)

log = logging.getLogger("stepstream.engine")


# The key of the workflow's own failure in ``RuntimeCore.tracebacks``.
WORKFLOW_TRACEBACK = ("", 0)


class RuntimeCore:
    """The state of one instance's runtime and what every part of it uses: the
    records it emits, the futures its code awaits, and how the coroutine is closed."""

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
        # Attempts of a previous run still in flight when a restart began a new one:
        # their outcomes (the new run may reuse their key and number) are dropped.
        self.stale_attempts: set[tuple[str, int]] = set()
        # Whether the last input was recorded as ignored (CommandIgnored), and why.
        self.ignored = False
        self.ignored_because = ""
        # The stored history and record bytes, for resets and forks (set by the owner).
        self.history: HistoryAccess | None = None
        # Set while the partition is handed over: attempts that run may finish, but no
        # new one starts (the next owner replays and starts it, losing no attempt).
        self.draining = False
        self._intents: dict[str, StepIntent] = {}
        self._loop: WorkflowLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._futures: dict[str, asyncio.Future[Any]] = {}
        self._visited: set[str] = set()
        self._counters: dict[str, int] = {}
        # Finished loop iterations' scopes ("<loop key>/<i>") not yet forgotten, and the
        # size of what the coroutine keeps at which they are (``_forget_scope``).
        self._forget_roots: set[str] = set()
        self._forget_at = FORGET_AT_LEAST
        # A name in its scope (scope + name) -> the task that used it last in this run,
        # and, for a name used more than once, how many times it was.
        # Each name's slot -> the task that used it last, and the loop's tick then.
        self._names: dict[str, tuple[asyncio.Task[Any] | None, int]] = {}
        self._repeats: dict[str, int] = {}
        self._patches: dict[str, bool] = {}  # ctx.patched answers of this run
        # Task paths of race branches that lost (replay starts and cancels them): the
        # values they recorded (ctx.now and friends, keyed by task path) are not reached.
        self._lost_tasks: list[str] = []
        # Ephemeral steps whose attempt runs with nothing recorded yet: key -> attempt.
        self._ephemeral: dict[str, int] = {}
        self._deferred: list[tuple[str, str]] = []
        self._replaying = False
        self._phase = Phase.IDLE
        # How long the last replay of the code took (seconds), until telemetry takes it.
        self.replayed_s: float | None = None
        self._diverged: HistoryDiverged | None = None
        self._out: Output = Output()
        self._command_id = ""
        self._traceparent: str | None = None
        self._tracestate: str | None = None
        # Tracebacks of the failures decided since the last commit, by (step key,
        # attempt) or ``WORKFLOW_TRACEBACK``: the log lines made once they are durable
        # take them (``consumers/failure_log.py``). Never recorded.
        self.tracebacks: dict[tuple[str, int], str] = {}
        # While a new instance's start is applied: the workflow's time, when the log took
        # the start (``consumers/partition/apply.py``). None: the engine's clock.
        self.clock_from_ms: int | None = None

    # ---- what Context reads (engine.api.runtime.WorkflowRuntime) -----------------------

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
        """The workflow's time: what ``ctx.now()`` records, and what a sleep or a timeout
        the code begins counts from."""
        at = self.clock_from_ms
        return self.clock.now_ms() if at is None else at

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
                self._phase = Phase.CLOSING
                try:
                    for task in pending:
                        task.cancel()
                    loop.run_until_quiet()
                except Exception:
                    log.exception("instance %s: unwinding the workflow failed", self.instance_id)
                finally:
                    self._phase = Phase.IDLE
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
        self.ignored_because = reason
        self._emit(CommandIgnored, command_type=msg.type, reason=reason)

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
        if entry is not None and entry.state.final:
            self._settle(fut, entry)
            if fut.done():
                return fut  # replayed: nothing will settle it again
        self._futures[key] = fut
        return fut

    def _resolve(self, entry: Entry) -> None:
        key = entry.key
        fut = self._futures.get(key)
        if fut is not None and not fut.done():
            self._settle(fut, entry)
            if fut.done():
                # Settled for good (a key is used once): the code that awaits it holds
                # it, and the runtime needs neither it nor the step's intent again. Kept,
                # every step's would stay in memory until its instance ends.
                del self._futures[key]
                self._intents.pop(key, None)

    def decode_recorded(self, payload: Payload, what: str) -> Any:
        """A value from the history, decoded. It was readable when it was recorded, so
        one this engine's codec cannot read was written by another codec, or under a key
        this engine lacks (a rotation under way): the instance is parked, as for a
        divergence, and goes on where an engine that reads it loads it."""
        try:
            return decode_safely(self.codec, payload)
        except StepstreamError as exc:
            err = RecordedPayloadUnreadable(
                f"instance {self.state.instance_id}: {what} cannot be decoded by this engine: {exc}"
            )
            self._diverged = self._diverged or err
            raise err from None

    def _settle(self, fut: asyncio.Future[Any], entry: Entry) -> None:
        if entry.names is not None and entry.state is EntryState.SATISFIED:
            fut.set_result(list(entry.messages or ()))  # raw: decoded where they are used
            return
        match entry.state:
            case EntryState.SUCCEEDED | EntryState.SATISFIED | EntryState.RECORDED:
                assert entry.result is not None
                try:
                    value = self.decode_recorded(entry.result, _recorded_what(entry))
                except RecordedPayloadUnreadable as exc:
                    fut.set_exception(exc)  # parked once the code is quiet
                else:
                    fut.set_result(value)
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
                if entry.names is not None:  # ctx.messages: one of several names
                    awaited = "no message " + " or ".join(repr(n) for n in entry.names)
                else:
                    awaited = f"no event {entry.event_name!r}"
                fut.set_exception(
                    EventTimeout(
                        f"instance {self.state.instance_id}: {awaited} arrived before the "
                        f"timeout of wait {entry.key!r}",
                        key=entry.key,
                        event_name=entry.event_name or ", ".join(entry.names or ()),
                    )
                )
            case _:
                pass

    def _overdue(self, entry: Entry) -> bool:
        return entry.fire_at_ms is not None and entry.fire_at_ms <= self.clock.now_ms()

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


def _recorded_what(entry: Entry) -> str:
    if entry.kind is EntryKind.WAIT:
        return f"the event {entry.event_name!r} that wait {entry.key!r} took"
    return f"the recorded result of {entry.kind.value} {entry.key!r}"


def _failure_kind(entry: Entry) -> str:
    if entry.error_type == CANCELLED_ATTEMPT:
        return "cancelled"
    if entry.error_type == "StepTimeout":
        return "timeout"
    # A body's NonRetryableError ends the step at whichever attempt raised it: at the last
    # one (an earlier attempt was lost to a crash, say) the count alone would read
    # "exhausted". A subclass is recorded by its own name: there only the count tells,
    # and a step that retries for ever (no limit: 0) can only have ended that way.
    if (
        entry.error_type == "NonRetryableError"
        or not entry.max_attempts
        or entry.attempt < entry.max_attempts
    ):
        return "non_retryable"
    return "exhausted"


def _child_result_key(key: str) -> str:
    return f"{key}/result"
