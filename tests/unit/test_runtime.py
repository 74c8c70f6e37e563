"""InstanceRuntime on its own: no backend, a fake clock, the JSON codec.

A small harness plays the partition processor: it feeds commands and step outcomes,
"commits" every Output at once (history kept, timers indexed, launches queued), runs step
bodies only when a test says so, and can crash: drop the runtime and its launches, fold
the committed history into a fresh InstanceState and ``recover`` a new runtime from it.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepstream.engine.api.context import Context
from stepstream.engine.api.retry import RetryPolicy
from stepstream.engine.api.workflow import WorkflowDefinition
from stepstream.engine.errors import EventTimeout, HistoryDiverged, StepFailed
from stepstream.engine.replay.runtime import (
    LOST_ATTEMPT,
    InstanceRuntime,
    Output,
    StepLaunch,
    StepOutcome,
)
from stepstream.engine.replay.state import EntryState, InstanceState, Status
from stepstream.engine.replay.state_json import meta_json
from stepstream.engine.wire.codec import JsonCodec
from stepstream.engine.wire.records import (
    CancelWorkflow,
    Command,
    EventBuffered,
    HistoryRecord,
    PauseWorkflow,
    ResumeWorkflow,
    SendEvent,
    SleepElapsed,
    SleepStarted,
    StartWorkflow,
    StepAttemptStarted,
    StepFailedRecord,
    StepSucceeded,
    TimerCancelled,
    TimerFired,
    TimerScheduled,
    ValueRecorded,
    WaitSatisfied,
    WorkflowFailedRecord,
)
from tests.fakes import T0, FakeClock

CODEC = JsonCodec()


_OPEN: list[Harness] = []


@pytest.fixture(autouse=True)
def _close_runtimes() -> Iterator[None]:
    """Close every runtime a test made, as the processor does when it drops one."""
    yield
    while _OPEN:
        _OPEN.pop().runtime.close()


def fold(instance_id: str, records: list[HistoryRecord]) -> InstanceState:
    state = InstanceState(instance_id)
    for record in records:
        state.apply(record)
    state.dirty_entries.clear()
    return state


def describe(records: list[HistoryRecord]) -> str:
    return "\n".join(f"  {r.seq:3d} {r!r}" for r in records)


class Harness:
    """One instance, driven the way the partition processor drives it."""

    def __init__(
        self,
        definition: WorkflowDefinition,
        *,
        instance_id: str = "inst-1",
        clock: FakeClock | None = None,
    ) -> None:
        self.definition = definition
        self.instance_id = instance_id
        self.clock = clock or FakeClock()
        self.epoch = 1
        self.records: list[HistoryRecord] = []
        self.timers: dict[str, int] = {}  # the durable timer index: timer id -> fire at
        self.launches: list[StepLaunch] = []  # attempts running, outcome not delivered yet
        self.ran: dict[str, int] = {}  # step key -> how many times its body ran
        self._ids = itertools.count(1)
        self.runtime = self._runtime(InstanceState(instance_id))
        _OPEN.append(self)

    def _runtime(self, state: InstanceState) -> InstanceRuntime:
        return InstanceRuntime(
            state, self.definition, codec=CODEC, clock=self.clock, epoch=self.epoch
        )

    @property
    def state(self) -> InstanceState:
        return self.runtime.state

    def _commit(self, out: Output) -> Output:
        self.records.extend(out.history)
        for timer in out.timers:
            if isinstance(timer, TimerScheduled):
                self.timers[timer.timer_id] = timer.fire_at_ms
            else:
                assert isinstance(timer, TimerCancelled)
                self.timers.pop(timer.timer_id, None)
        self.launches.extend(out.launches)
        return out

    def feed(self, msg: Command | StepOutcome) -> Output:
        out = Output()
        self.runtime.handle(msg, out)
        return self._commit(out)

    # ---- commands ---------------------------------------------------------------------

    def start(self, value: Any = None, *, command_id: str = "start-1") -> Output:
        return self.feed(
            StartWorkflow(
                instance_id=self.instance_id,
                command_id=command_id,
                workflow=self.definition.name,
                input=CODEC.encode(value),
            )
        )

    def send(self, name: str, payload: Any, *, command_id: str | None = None) -> Output:
        return self.feed(
            SendEvent(
                instance_id=self.instance_id,
                command_id=command_id or f"event-{next(self._ids)}",
                name=name,
                payload=CODEC.encode(payload),
            )
        )

    def fire(self, timer_id: str | None = None, *, keep: bool = False) -> Output:
        """Fire a timer (the earliest if none given) as the timer service would: never
        before its time, so the clock moves forward to it."""
        if timer_id is None:
            timer_id = min(self.timers, key=lambda t: (self.timers[t], t))
        fire_at = self.timers[timer_id] if keep else self.timers.pop(timer_id)
        self.clock.ms = max(self.clock.ms, fire_at)
        return self.feed(
            TimerFired(
                instance_id=self.instance_id,
                command_id=f"fire:{timer_id}",
                time_ms=self.clock.ms,
                timer_id=timer_id,
                fire_at_ms=fire_at,
            )
        )

    # ---- step attempts ----------------------------------------------------------------

    def launch(self, key: str) -> StepLaunch:
        found = [launch for launch in self.launches if launch.key == key]
        assert found, f"no attempt of {key!r} is running; launches: {self.launches}"
        return found[-1]

    def succeed(self, key: str, value: Any = None) -> Output:
        launch = self.launch(key)
        self.launches.remove(launch)
        return self.feed(StepOutcome(self.instance_id, key, launch.attempt, CODEC.encode(value)))

    def fail(
        self,
        key: str,
        message: str = "boom",
        *,
        retryable: bool = True,
        error_type: str = "RuntimeError",
    ) -> Output:
        launch = self.launch(key)
        self.launches.remove(launch)
        return self.feed(
            StepOutcome(
                self.instance_id,
                key,
                launch.attempt,
                error_type=error_type,
                error_message=message,
                retryable=retryable,
            )
        )

    def run(self, key: str) -> Output:
        """Run the body of the attempt of ``key`` that is in flight, then deliver it."""
        launch = self.launch(key)
        self.launches.remove(launch)
        self.ran[key] = self.ran.get(key, 0) + 1
        try:
            value = launch.fn(*launch.args, **launch.kwargs)
            if inspect.isawaitable(value):
                value = asyncio.run(value)  # type: ignore[arg-type]
        except Exception as exc:
            outcome = StepOutcome(
                self.instance_id,
                key,
                launch.attempt,
                error_type=type(exc).__name__,
                error_message=str(exc),
            )
        else:
            outcome = StepOutcome(self.instance_id, key, launch.attempt, CODEC.encode(value))
        return self.feed(outcome)

    def run_all(self, *, timers: bool = True) -> None:
        """Run step bodies and fire timers until the instance is blocked on something
        only the test can supply (an event) or finished."""
        for _ in range(10_000):
            if self.launches:
                self.run(self.launches[0].key)
            elif timers and self.timers and not self.state.status.finished:
                self.fire()
            else:
                return
        raise AssertionError("instance never settled")

    # ---- crashes ----------------------------------------------------------------------

    def crash(self) -> Output:
        """kill -9: in-flight attempts and the cached coroutine are gone; a new owner
        (next epoch) folds the committed history and recovers the instance."""
        self.runtime.close()
        self.launches.clear()
        self.epoch += 1
        self.runtime = self._runtime(fold(self.instance_id, self.records))
        out = Output()
        self.runtime.recover(out)
        return self._commit(out)

    # ---- reading history --------------------------------------------------------------

    def of_type(self, cls: type[HistoryRecord], key: str | None = None) -> list[Any]:
        return [
            r
            for r in self.records
            if isinstance(r, cls) and (key is None or getattr(r, "key", None) == key)
        ]

    def result(self) -> Any:
        assert self.state.status is Status.COMPLETED, (
            f"instance is {self.state.status.value}: {self.state.error_type} "
            f"{self.state.error_message}\n{describe(self.records)}"
        )
        assert self.state.result is not None
        return CODEC.decode(self.state.result)

    def check_history(self) -> None:
        """Invariants of every history: dense seqs, at most one success per key."""
        seqs = [r.seq for r in self.records]
        assert seqs == list(range(1, len(seqs) + 1)), describe(self.records)
        succeeded = [r.key for r in self.of_type(StepSucceeded)]
        assert len(succeeded) == len(set(succeeded)), describe(self.records)


def define(name: str, fn: Callable[..., Any], version: str = "1") -> WorkflowDefinition:
    return WorkflowDefinition(name, version, fn)


def ident(value: Any) -> Any:
    return value


def add(a: int, b: int) -> int:
    return a + b


async def async_double(x: int) -> int:
    await asyncio.sleep(0)
    return x * 2


# ---- a straight run -------------------------------------------------------------------


async def _arith(ctx: Context, n: int) -> dict[str, int]:
    total = await ctx.step("add", add, n, 1)
    doubled = await ctx.step("double", async_double, total)
    return {"total": total, "doubled": doubled}


ARITH = define("arith", _arith)


def test_straight_run_records_each_transition_once() -> None:
    h = Harness(ARITH)
    out = h.start(4)
    assert [r.type for r in out.history] == ["WorkflowStarted", "StepAttemptStarted"]
    assert [launch.key for launch in out.launches] == ["add"]
    h.run_all()
    assert h.result() == {"total": 5, "doubled": 10}
    assert [r.type for r in h.records] == [
        "WorkflowStarted",
        "StepAttemptStarted",
        "StepSucceeded",
        "StepAttemptStarted",
        "StepSucceeded",
        "WorkflowCompleted",
    ]
    assert h.ran == {"add": 1, "double": 1}
    h.check_history()
    assert all(r.instance_id == "inst-1" and r.epoch == 1 for r in h.records)
    assert h.records[0].command_id == "start-1"
    assert h.records[2].command_id == "step:inst-1/add/1"


def test_duplicate_start_is_recorded_and_ignored() -> None:
    h = Harness(ARITH)
    h.start(1)
    assert h.start(1).history == []  # same command id: a re-delivery changes nothing
    out = h.start(100, command_id="start-2")
    assert [r.type for r in out.history] == ["CommandIgnored"]
    assert out.launches == []
    h.run_all()
    assert h.result() == {"total": 2, "doubled": 4}


# ---- replay determinism ---------------------------------------------------------------


async def _values_around_sleep(ctx: Context, _: Any) -> dict[str, Any]:
    now = ctx.now()
    ident_ = ctx.uuid()
    rnd = ctx.random()
    first = await ctx.step("first", ident, "one")
    await ctx.sleep("nap", 60)
    second = await ctx.step("second", ident, "two")
    later = ctx.now()
    return {
        "now": now.isoformat(),
        "uuid": str(ident_),
        "random": rnd,
        "later": later.isoformat(),
        "steps": [first, second],
    }


VALUES = define("values", _values_around_sleep)


def test_replay_resumes_without_relaunching_completed_steps() -> None:
    live = Harness(VALUES)
    live.start(None)
    live.run("first")
    assert live.state.entries["nap"].state is EntryState.SLEEPING
    before_crash = list(live.records)

    out = live.crash()

    # Nothing new: the replayed code found every key in the history and stopped at the
    # sleep, whose timer is already durable.
    assert out.history == [] and out.launches == [] and out.timers == []
    assert live.state.seq == before_crash[-1].seq
    assert live.ran == {"first": 1}
    live.run_all()
    assert live.ran == {"first": 1, "second": 1}
    live.check_history()
    assert [r.key for r in live.of_type(StepAttemptStarted)] == ["first", "second"]
    assert len(live.of_type(ValueRecorded)) == 4  # now, uuid, random, now (after the sleep)


def test_now_uuid_random_are_the_recorded_values_on_replay() -> None:
    reference = Harness(VALUES)
    reference.start(None)
    reference.run_all()
    expected = reference.result()

    crashed = Harness(VALUES)
    cut = next(i for i, r in enumerate(reference.records) if isinstance(r, SleepStarted))
    crashed.records = reference.records[: cut + 1]  # started, 3 values, step "first", nap
    crashed.clock.advance(3600)  # replayed an hour later: ctx.now() must not move
    out = crashed.crash()
    # The overdue sleep is not decided by the recovery but by its durable timer's fire,
    # which comes through the command log after whatever is already there.
    assert out.history == []
    nap = crashed.state.entries[reference.records[cut].key]
    assert nap.timer_id is not None and nap.fire_at_ms is not None
    crashed.timers[nap.timer_id] = nap.fire_at_ms
    assert [r.type for r in crashed.fire().history] == ["SleepElapsed", "StepAttemptStarted"]
    crashed.run_all()
    got = crashed.result()
    assert len(crashed.of_type(ValueRecorded)) == 4
    assert {k: got[k] for k in ("now", "uuid", "random")} == {
        k: expected[k] for k in ("now", "uuid", "random")
    }
    assert got["later"] > expected["later"]  # recorded after the crash: the new time


async def _two_naps(ctx: Context, _: Any) -> int:
    await ctx.sleep("first", 1)
    await ctx.sleep("second", 1)
    return 0


TWO_NAPS = define("two-naps", _two_naps)


def test_a_start_applied_late_sleeps_from_when_it_was_taken_then_from_each_wake() -> None:
    """docs/workflows.md, "Workflow time": the first sleep counts from when the start was
    taken; applied 5 s later, it is over at once, and the next counts from then."""
    h = Harness(TWO_NAPS)
    taken = h.clock.ms
    h.clock.advance(5)
    h.runtime.clock_from_ms = taken  # as the partition's applier sets it for a new instance
    try:
        h.start(None)
    finally:
        h.runtime.clock_from_ms = None
    first, second = h.of_type(SleepStarted)
    assert first.wake_at_ms == taken + 1000
    assert [r.type for r in h.records].count("SleepElapsed") == 1  # the first, at once
    assert second.wake_at_ms == h.clock.ms + 1000  # from when the first was over


def test_fold_of_emitted_records_equals_live_state() -> None:
    h = Harness(VALUES)
    h.start(None)
    h.run_all()
    rebuilt = fold("inst-1", h.records)
    assert meta_json(rebuilt) == meta_json(h.state)
    assert rebuilt.entries == h.state.entries


# ---- history divergence ---------------------------------------------------------------


async def _a_then_b(ctx: Context, _: Any) -> str:
    await ctx.step("a", ident, "a")
    await ctx.step("b", ident, "b")
    await ctx.wait_for_event("go")
    return "done"


async def _a_then_x(ctx: Context, _: Any) -> str:
    await ctx.step("a", ident, "a")
    await ctx.step("x", ident, "x")
    await ctx.wait_for_event("go")
    return "done"


async def _a_then_sleep_b(ctx: Context, _: Any) -> str:
    await ctx.step("a", ident, "a")
    await ctx.sleep("b", 1)
    await ctx.wait_for_event("go")
    return "done"


def _history_of_version_a() -> Harness:
    h = Harness(define("div", _a_then_b, "1"))
    h.start(None)
    h.run_all()
    assert h.state.entries["go"].state is EntryState.WAITING
    return h


def test_renamed_step_is_history_diverged_naming_the_recorded_key() -> None:
    """The runtime raises HistoryDiverged out of recover(); its owner parks the instance
    and keeps nothing the replay decided (tests/faults/test_parked.py)."""
    h = _history_of_version_a()
    h.definition = define("div", _a_then_x, "1")  # same name and version, new code
    with pytest.raises(HistoryDiverged) as diverged:
        h.crash()
    assert diverged.value.key == "b"
    assert "'b'" in str(diverged.value) and "seq 4" in str(diverged.value)
    assert h.runtime.diverged is diverged.value
    assert h.launches == []  # the new step 'x' never runs
    assert h.state.status is Status.RUNNING


def test_step_that_became_a_sleep_is_history_diverged() -> None:
    h = _history_of_version_a()
    h.definition = define("div", _a_then_sleep_b, "1")
    with pytest.raises(HistoryDiverged) as diverged:
        h.crash()
    assert "step 'b'" in str(diverged.value) and "sleep" in str(diverged.value)
    assert h.timers == {} and h.launches == []


def test_unchanged_code_replays_cleanly() -> None:
    h = _history_of_version_a()
    out = h.crash()
    assert out.history == []
    h.send("go", 1)
    assert h.result() == "done"


async def _same_name_twice(ctx: Context, _: Any) -> list[Any]:
    return [await ctx.step("same", ident, 1), await ctx.step("same", ident, 2)]


def test_a_name_used_twice_is_two_keys() -> None:
    h = Harness(define("twice", _same_name_twice))
    h.start(None)
    h.run_all()
    assert h.result() == [1, 2]
    assert h.ran == {"same": 1, "same#2": 1}


# ---- attempts lost with a crash -------------------------------------------------------


def _long(max_attempts: int) -> WorkflowDefinition:
    async def long_step(ctx: Context, _: Any) -> str:
        policy = RetryPolicy(max_attempts=max_attempts, initial_interval=1)
        result: str = await ctx.step("long", ident, "long", retry=policy)
        await ctx.step("tail", ident, "tail")
        return result

    return define("long-step", long_step)


def test_lost_attempt_is_failed_and_the_next_one_launched_on_its_timer() -> None:
    h = Harness(_long(3))
    h.start(None)
    assert h.launch("long").attempt == 1
    out = h.crash()
    # Nothing is decided on recovery: a timer due now decides, through the command log.
    assert out.history == [] and out.launches == []
    assert [(t.timer_id, t.fire_at_ms, t.purpose) for t in out.timers] == [
        ("inst-1/lost/1/long", h.clock.ms, "lost")
    ]
    out = h.fire()
    assert [(r.type, getattr(r, "attempt", None)) for r in out.history] == [
        ("StepFailed", 1),
        ("StepAttemptStarted", 2),
    ]
    lost = out.history[0]
    assert isinstance(lost, StepFailedRecord)
    assert lost.error_type == LOST_ATTEMPT
    assert lost.next_attempt_at_ms == h.clock.ms  # no backoff for an interrupted attempt
    assert [(launch.key, launch.attempt) for launch in out.launches] == [("long", 2)]
    assert all(r.epoch == 2 for r in out.history)
    again = TimerFired(
        instance_id="inst-1", command_id="again", timer_id="inst-1/lost/1/long", fire_at_ms=1
    )
    assert h.feed(again).history == []  # a second fire finds attempt 2 running: no change
    h.run_all()
    assert h.result() == "long"
    h.check_history()


def test_crashes_use_up_attempts_and_the_step_fails_for_good() -> None:
    h = Harness(_long(2))
    h.start(None)
    h.crash()
    h.fire()  # attempt 1 lost, attempt 2 launched
    assert h.crash().history == []
    out = h.fire()  # attempt 2 lost: none left
    assert [r.type for r in out.history] == ["StepFailed", "WorkflowFailed"]
    final = out.history[0]
    assert isinstance(final, StepFailedRecord)
    assert final.attempt == 2 and final.next_attempt_at_ms is None
    assert final.error_type == LOST_ATTEMPT
    failed = out.history[1]
    assert isinstance(failed, WorkflowFailedRecord)
    assert failed.error_type == "StepFailed" and LOST_ATTEMPT in failed.error_message
    assert out.launches == []
    assert len(h.of_type(StepAttemptStarted, "long")) == 2


def test_single_attempt_lost_fails_on_its_timer() -> None:
    h = Harness(_long(1))
    h.start(None)
    h.crash()
    out = h.fire()
    assert [r.type for r in out.history] == ["StepFailed", "WorkflowFailed"]
    assert out.launches == []
    assert h.of_type(StepAttemptStarted, "tail") == []


def test_a_cancel_on_the_log_wins_over_a_last_attempt_lost_with_the_previous_owner() -> None:
    """The previous owner stopped with the last attempt in flight and a cancel was
    acknowledged behind it: the cancel applies, and the workflow code (which would see
    the step fail and could finish) does not run on."""
    h = Harness(_long(1))
    h.start(None)
    assert h.crash().history == []
    ((timer_id, fire_at),) = h.timers.items()
    cancelled = h.feed(_command(CancelWorkflow, "c-1"))
    assert [r.type for r in cancelled.history][-1] == "WorkflowCancelled"
    late = TimerFired(
        instance_id=h.instance_id, command_id="fire:lost", timer_id=timer_id, fire_at_ms=fire_at
    )
    assert h.feed(late).history == []
    assert h.state.status.value == "cancelled"
    assert h.of_type(StepFailedRecord) == []


def test_a_lost_attempt_whose_runtime_was_dropped_is_decided_on_its_timer() -> None:
    """The runtime that set the timer is gone when it fires (evicted, or the instance
    moved): the fresh runtime's replay finds the attempt lost and decides it then."""
    h = Harness(_long(3))
    h.start(None)
    h.crash()
    h.runtime.close()
    h.runtime = h._runtime(fold(h.instance_id, h.records))
    out = h.fire()
    assert [(r.type, getattr(r, "attempt", None)) for r in out.history] == [
        ("StepFailed", 1),
        ("StepAttemptStarted", 2),
    ]
    h.run_all()
    assert h.result() == "long"


def test_crash_during_backoff_keeps_the_attempt_count() -> None:
    h = Harness(_long(3))
    h.start(None)
    h.fail("long")
    assert h.state.entries["long"].state is EntryState.BACKOFF
    out = h.crash()
    assert out.history == [] and out.launches == []  # the retry timer is durable
    h.fire()
    assert h.launch("long").attempt == 2
    h.run_all()
    assert h.result() == "long"


def test_an_overdue_retry_starts_on_its_timer_after_recover() -> None:
    h = Harness(_long(3))
    h.start(None)
    h.fail("long")
    h.clock.advance(5)  # the retry timer is overdue when the new owner comes up
    assert h.crash().history == []  # left to the timer: commands on the log apply first
    assert [(r.type, getattr(r, "attempt", None)) for r in h.fire().history] == [
        ("StepAttemptStarted", 2)
    ]
    h.run_all()
    assert h.result() == "long"


# ---- duplicates and stale inputs ------------------------------------------------------


async def _nap(ctx: Context, _: Any) -> str:
    await ctx.sleep("nap", 5)
    return await ctx.step("after", ident, "after")


def test_duplicate_timer_fired_is_harmless() -> None:
    h = Harness(define("nap", _nap))
    h.start(None)
    (timer,) = h.timers
    assert h.timers[timer] == T0 + 5000
    first = h.fire(timer, keep=True)
    assert [r.type for r in first.history] == ["SleepElapsed", "StepAttemptStarted"]
    assert h.fire(timer, keep=True).history == []  # same command id
    duplicate = TimerFired(
        instance_id="inst-1", command_id="fire-again", timer_id=timer, fire_at_ms=T0 + 5000
    )
    assert h.feed(duplicate).history == []  # another command id, same timer
    assert h.feed(duplicate).launches == []
    h.run_all(timers=False)
    assert h.result() == "after"
    assert len(h.of_type(SleepElapsed)) == 1


def test_timer_fired_for_unknown_timer_is_ignored() -> None:
    h = Harness(define("nap", _nap))
    h.start(None)
    stray = TimerFired(
        instance_id="inst-1", command_id="stray", timer_id="inst-1/sleep/9/nap", fire_at_ms=T0
    )
    assert h.feed(stray).history == []
    assert h.state.entries["nap"].state is EntryState.SLEEPING


def test_fire_of_an_earlier_schedule_does_not_end_a_sleep_early() -> None:
    h = Harness(define("nap", _nap))
    h.start(None)
    (timer,) = h.timers
    early = TimerFired(
        instance_id="inst-1", command_id="early", timer_id=timer, fire_at_ms=T0 + 1000
    )
    assert h.feed(early).history == []
    assert h.state.entries["nap"].state is EntryState.SLEEPING
    h.run_all()
    assert h.result() == "after"


def test_sleep_elapses_at_or_after_wake_time() -> None:
    h = Harness(define("nap", _nap))
    h.start(None)
    h.run_all()
    (started,) = h.of_type(SleepStarted)
    (elapsed,) = h.of_type(SleepElapsed)
    assert elapsed.time_ms >= started.wake_at_ms == T0 + 5000


def test_stale_step_outcome_is_ignored() -> None:
    h = Harness(_long(3))
    h.start(None)
    stale = h.launch("long")
    h.fail("long")
    h.fire()  # attempt 2 starts
    assert h.launch("long").attempt == 2
    late = StepOutcome("inst-1", "long", stale.attempt, CODEC.encode("late"))
    out = h.feed(late)
    assert out.history == [] and out.launches == []
    assert h.state.entries["long"].state is EntryState.RUNNING
    h.run_all()
    assert h.result() == "long"
    # Redelivering a success already applied changes nothing either.
    again = StepOutcome("inst-1", "long", 2, CODEC.encode("again"))
    assert h.feed(again).history == []
    h.check_history()


def test_outcome_for_unknown_key_is_ignored() -> None:
    h = Harness(_long(3))
    h.start(None)
    assert h.feed(StepOutcome("inst-1", "nope", 1, CODEC.encode(1))).history == []


def test_outcome_after_lost_attempt_is_ignored() -> None:
    h = Harness(_long(3))
    h.start(None)
    old = h.launch("long")
    h.crash()
    h.fire()  # the lost attempt is decided: attempt 2 runs
    out = h.feed(StepOutcome("inst-1", "long", old.attempt, CODEC.encode("from the dead")))
    assert out.history == []
    h.run_all()
    assert h.result() == "long"


# ---- events ---------------------------------------------------------------------------


async def _two_items(ctx: Context, _: Any) -> list[Any]:
    await ctx.step("first", ident, 0)
    one = await ctx.wait_for_event("item", key="item-1")
    two = await ctx.wait_for_event("item", key="item-2")
    return [one, two]


def test_event_buffered_then_claimed_once() -> None:
    h = Harness(define("items", _two_items))
    h.start(None)
    out = h.send("item", "a", command_id="ev-a")
    assert [r.type for r in out.history] == ["EventBuffered"]
    assert h.send("item", "a", command_id="ev-a").history == []  # re-delivered: nothing
    h.send("item", "b", command_id="ev-b")
    assert [b.name for b in h.state.buffered] == ["item", "item"]
    h.run("first")
    assert h.result() == ["a", "b"]
    claims = h.of_type(WaitSatisfied)
    assert [(c.key, c.event_command_id) for c in claims] == [
        ("item-1", "ev-a"),
        ("item-2", "ev-b"),
    ]
    assert h.state.buffered == []
    h.check_history()


def test_buffered_event_is_not_claimed_twice_after_replay() -> None:
    h = Harness(define("items", _two_items))
    h.start(None)
    h.send("item", "a", command_id="ev-a")
    h.run("first")
    assert h.state.entries["item-2"].state is EntryState.WAITING
    out = h.crash()
    assert out.history == []
    h.send("item", "b", command_id="ev-b")
    assert h.result() == ["a", "b"]
    assert len(h.of_type(WaitSatisfied)) == 2
    assert len(h.of_type(EventBuffered)) == 1


def test_event_for_finished_instance_is_recorded_and_ignored() -> None:
    h = Harness(define("items", _two_items))
    h.start(None)
    h.send("item", 1)
    h.send("item", 2)
    h.run_all()
    out = h.send("item", 3)
    assert [r.type for r in out.history] == ["CommandIgnored"]
    assert h.result() == [1, 2]


async def _wait_with_timeout(ctx: Context, _: Any) -> Any:
    try:
        return await ctx.wait_for_event("approval", timeout=10)
    except EventTimeout:
        return "timed out"


def test_wait_times_out_and_a_late_event_is_ignored() -> None:
    h = Harness(define("wt", _wait_with_timeout))
    h.start(None)
    h.fire()
    assert h.result() == "timed out"
    assert [r.type for r in h.send("approval", 1).history] == ["CommandIgnored"]


def test_event_cancels_the_wait_timeout_timer() -> None:
    h = Harness(define("wt", _wait_with_timeout))
    h.start(None)
    assert len(h.timers) == 1
    h.send("approval", "yes")
    assert h.timers == {}
    assert h.result() == "yes"


# ---- pause, resume, cancel ------------------------------------------------------------


def test_pause_holds_the_code_and_resume_replays_it() -> None:
    h = Harness(define("items", _two_items))
    h.start(None)
    h.run("first")
    h.feed(_command(PauseWorkflow, "p-1"))
    assert h.state.status is Status.PAUSED
    h.send("item", 1)
    out = h.send("item", 2)
    # The first event satisfies the waiting key; the code does not move on while paused.
    assert [r.type for r in out.history] == ["EventBuffered"]
    h.feed(_command(ResumeWorkflow, "r-1"))
    assert h.result() == [1, 2]
    h.check_history()


def test_cancel_cancels_pending_timers() -> None:
    h = Harness(define("nap", _nap))
    h.start(None)
    out = h.feed(_command(CancelWorkflow, "c-1"))
    assert [r.type for r in out.history] == ["WorkflowCancelled"]
    assert h.timers == {}
    assert h.state.status is Status.CANCELLED
    stale = TimerFired(instance_id="inst-1", command_id="late", timer_id="t", fire_at_ms=T0)
    assert h.feed(stale).history == []


def _command(cls: type[Command], command_id: str) -> Command:
    return cls(instance_id="inst-1", command_id=command_id)


# ---- values read in concurrent branches -----------------------------------------------


async def _branch(ctx: Context, name: str) -> list[Any]:
    await ctx.step(name, ident, name)
    value = ctx.random()
    await ctx.sleep(f"{name}-nap", 10)
    return [name, value]


async def _two_branches(ctx: Context, _: Any) -> list[Any]:
    return list(await asyncio.gather(_branch(ctx, "a"), _branch(ctx, "b")))


def test_values_in_parallel_branches_replay_to_the_branch_that_read_them() -> None:
    """Live, branch b finishes its step first and reads its value before branch a does.
    On replay both steps are already done, so the branches run in code order; each must
    still get the value it read live (values are keyed by the task that read them)."""
    h = Harness(define("branches", _two_branches))
    h.start(None)
    h.succeed("b", "b")
    h.succeed("a", "a")
    live = {r.key: CODEC.decode(r.value) for r in h.of_type(ValueRecorded)}
    h.crash()
    h.run_all()
    result = h.result()
    assert sorted(live) == ["main.0/random#1", "main.1/random#1"], describe(h.records)
    assert live["main.0/random#1"] != live["main.1/random#1"]
    assert result == [["a", live["main.0/random#1"]], ["b", live["main.1/random#1"]]], describe(
        h.records
    )


# ---- property: replay reaches the state of the live run -------------------------------

# A generated workflow is a list of operations run in order; "par" runs two steps with
# asyncio.gather. Every step has a retry policy of 1-3 attempts and catches StepFailed.
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("par"), st.integers(1, 3)),
        st.tuples(st.just("sleep"), st.integers(0, 3)),
        st.tuples(st.just("wait"), st.sampled_from(["x", "y"])),
        st.tuples(st.just("value"), st.sampled_from(["now", "uuid", "random"])),
    ),
    min_size=1,
    max_size=7,
)
_ACTIONS = ["succeed", "fail", "fatal", "fire", "send", "crash", "redeliver", "pause", "resume"]
_PROGRESS = {"succeed", "fire", "send", "resume"}


def _generated(ops: list[tuple[str, Any]]) -> WorkflowDefinition:
    async def guarded_step(ctx: Context, key: str, attempts: int) -> Any:
        policy = RetryPolicy(max_attempts=attempts, initial_interval=0.5)
        try:
            return await ctx.step(key, ident, key, retry=policy)
        except StepFailed as exc:
            return f"failed:{key}:{exc.attempts}"

    async def generated(ctx: Context, _: Any) -> list[Any]:
        out: list[Any] = []
        for i, (kind, arg) in enumerate(ops):
            if kind == "step":
                out.append(await guarded_step(ctx, f"s{i}", arg))
            elif kind == "par":
                out.append(
                    await asyncio.gather(
                        guarded_step(ctx, f"p{i}a", arg), guarded_step(ctx, f"p{i}b", arg)
                    )
                )
            elif kind == "sleep":
                await ctx.sleep(f"z{i}", arg)
                out.append("slept")
            elif kind == "wait":
                out.append(await ctx.wait_for_event(arg, key=f"w{i}"))
            else:
                value = {"now": ctx.now, "uuid": ctx.uuid, "random": ctx.random}[arg]()
                out.append(str(value))
        return out

    return define("generated", generated)


def _expected_result(ops: list[tuple[str, Any]], h: Harness) -> list[Any]:
    """What the generated workflow must return, read off its history alone."""

    def step(key: str) -> Any:
        if h.of_type(StepSucceeded, key):
            return key
        (final,) = [f for f in h.of_type(StepFailedRecord, key) if f.next_attempt_at_ms is None]
        return f"failed:{key}:{final.attempt}"

    values = iter(h.of_type(ValueRecorded))
    expected: list[Any] = []
    for i, (kind, _) in enumerate(ops):
        if kind == "step":
            expected.append(step(f"s{i}"))
        elif kind == "par":
            expected.append([step(f"p{i}a"), step(f"p{i}b")])
        elif kind == "sleep":
            expected.append("slept")
        elif kind == "wait":
            (claim,) = h.of_type(WaitSatisfied, f"w{i}")
            expected.append(CODEC.decode(claim.payload))
        else:
            record = next(values)
            raw = CODEC.decode(record.value)
            if record.kind == "now":
                expected.append(str(datetime.fromtimestamp(raw / 1000, tz=UTC)))
            else:
                expected.append(str(raw))
    return expected


def _equal_states(a: InstanceState, b: InstanceState) -> bool:
    return meta_json(a) == meta_json(b) and a.entries == b.entries


@settings(
    max_examples=int(os.environ.get("STEPSTREAM_PROPERTY_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(ops=_OPS, data=st.data())
def test_property_replay_reaches_the_live_state(
    ops: list[tuple[str, Any]], data: st.DataObject
) -> None:
    """Random workflows under random interleavings of outcomes, timer fires, events,
    re-deliveries, pauses and crashes: the live state is always the fold of the committed
    history, and replaying the code over that history decides what the live run decided."""
    h = Harness(_generated(ops))
    h.start(None)
    to_send = [arg for kind, arg in ops if kind == "wait"]  # one event per wait
    sent: dict[str, int] = {}
    for turn in range(400):
        status = h.state.status
        if status.finished and not to_send:
            break
        possible = {
            "succeed": bool(h.launches),
            "fail": bool(h.launches),
            "fatal": bool(h.launches),
            "fire": bool(h.timers) and not status.finished,
            "send": bool(to_send),
            "crash": True,
            "redeliver": bool(sent),
            "pause": status in (Status.PENDING, Status.RUNNING),
            "resume": status is Status.PAUSED,
        }
        if turn >= 300:  # enough chaos: from here on only moves that make progress
            possible = {a: ok and a in _PROGRESS for a, ok in possible.items()}
        action = data.draw(st.sampled_from([a for a in _ACTIONS if possible[a]]), label="do")
        if action in ("succeed", "fail", "fatal"):
            launch = data.draw(st.sampled_from(h.launches), label="attempt")
            if action == "succeed":
                h.succeed(launch.key, launch.key)
            else:
                h.fail(launch.key, retryable=action == "fail")
        elif action == "fire":
            h.fire(data.draw(st.sampled_from(sorted(h.timers)), label="timer"))
        elif action == "send":
            name = to_send.pop(data.draw(st.integers(0, len(to_send) - 1), label="event"))
            sent[name] = sent.get(name, 0) + 1
            h.send(name, f"{name}{sent[name]}", command_id=f"ev-{name}-{sent[name]}")
        elif action == "crash":
            h.crash()
        elif action == "redeliver":  # the same command twice changes nothing
            name = data.draw(st.sampled_from(sorted(sent)), label="again")
            n = sent[name]
            assert h.send(name, f"{name}{n}", command_id=f"ev-{name}-{n}").history == []
        elif action == "pause":
            h.feed(_command(PauseWorkflow, f"pause-{len(h.records)}"))
        else:
            h.feed(_command(ResumeWorkflow, f"resume-{len(h.records)}"))

        assert _equal_states(fold("inst-1", h.records), h.state), describe(h.records)
        h.check_history()
    else:
        raise AssertionError(f"did not finish:\n{describe(h.records)}")

    result = h.result()
    assert result == _expected_result(ops, h), describe(h.records)
    # Attempts are numbered 1..n per key, n within the policy: crashes included.
    attempts: dict[str, list[int]] = {}
    for started in h.of_type(StepAttemptStarted):
        assert started.attempt <= started.max_attempts, describe(h.records)
        attempts.setdefault(started.key, []).append(started.attempt)
    for numbers in attempts.values():
        assert numbers == list(range(1, len(numbers) + 1)), describe(h.records)
    for name in ("x", "y"):  # events of one name are claimed in the order they were sent
        claimed = [CODEC.decode(c.payload) for c in h.of_type(WaitSatisfied)]
        assert [c for c in claimed if c.startswith(name)] == [
            f"{name}{i + 1}" for i in range(sent.get(name, 0))
        ]

    # Replaying the code over the history minus its last record decides that record again.
    replay = Harness(h.definition, clock=FakeClock(h.clock.ms + 10**6))
    replay.records = h.records[:-1]
    out = replay.crash()
    assert [r.type for r in out.history] == ["WorkflowCompleted"], (
        f"{describe(h.records)}\nreplay decided:\n{describe(out.history)}"
    )
    assert replay.result() == result
    assert out.launches == []


# ---- retry backoff --------------------------------------------------------------------


def test_retry_delays_grow_by_the_backoff_and_stop_at_the_cap() -> None:
    policy = RetryPolicy(max_attempts=6, initial_interval=0.2, backoff=3.0, max_interval=2.0)

    async def flaky(ctx: Context, _: Any) -> str:
        try:
            return str(await ctx.step("flaky", ident, "x", retry=policy))
        except StepFailed as exc:
            return f"gave up after {exc.attempts}"

    h = Harness(define("flaky", flaky))
    h.start(None)
    delays = []
    for _ in range(5):
        h.fail("flaky")
        [failed] = h.of_type(StepFailedRecord, "flaky")[-1:]
        assert failed.next_attempt_at_ms is not None
        delays.append(failed.next_attempt_at_ms - h.clock.ms)
        timer = h.state.entries["flaky"].timer_id
        assert timer is not None and h.timers[timer] == failed.next_attempt_at_ms
        h.fire()  # the retry waits for its timer: no attempt before it fires
    assert delays == [200, 600, 1800, 2000, 2000]
    h.fail("flaky")
    last = h.of_type(StepFailedRecord, "flaky")[-1]
    assert last.attempt == 6 and last.next_attempt_at_ms is None
    assert h.result() == "gave up after 6"
    assert len(h.of_type(StepAttemptStarted, "flaky")) == 6


def test_retry_policy_delay_formula_and_validation() -> None:
    policy = RetryPolicy(initial_interval=0.1, backoff=2.0, max_interval=0.5)
    assert [policy.delay_ms(n) for n in range(1, 6)] == [100, 200, 400, 500, 500]
    assert RetryPolicy(initial_interval=0.2, backoff=3.0).delay_ms(2) == 600
    assert RetryPolicy(initial_interval=1, backoff=1.0).delay_ms(10) == 1000
    for bad in (
        {"max_attempts": 0},
        {"initial_interval": -1},
        {"max_interval": -1},
        {"backoff": 0.5},
    ):
        with pytest.raises(ValueError, match="RetryPolicy"):
            RetryPolicy(**bad)  # type: ignore[arg-type]


# ---- graceful hand-over -----------------------------------------------------------------


def test_a_draining_instance_records_running_attempts_and_starts_nothing_new() -> None:
    h = Harness(_long(1))
    h.start(None)
    h.runtime.draining = True
    out = h.run("long")  # the attempt that was running finishes during the drain
    assert [r.type for r in out.history] == ["StepSucceeded"]
    assert out.launches == [] and h.of_type(StepAttemptStarted, "tail") == []
    # The next owner replays and starts the held step as its first attempt.
    out = h.crash()
    assert [
        (r.type, getattr(r, "key", None), getattr(r, "attempt", None)) for r in out.history
    ] == [("StepAttemptStarted", "tail", 1)]
    h.run_all()
    assert h.result() == "long"
    h.check_history()


def test_a_draining_instance_leaves_a_retry_to_the_next_owner() -> None:
    h = Harness(_long(3))
    h.start(None)
    h.fail("long")
    h.runtime.draining = True
    out = h.fire()
    assert out.history == [] and out.launches == []  # due, but not started here...
    assert [t.purpose for t in out.timers if isinstance(t, TimerScheduled)] == ["retry"]
    assert h.crash().history == []
    assert [(r.type, getattr(r, "attempt", None)) for r in h.fire().history] == [
        ("StepAttemptStarted", 2)  # ...its timer, armed again, fires for the next owner
    ]
    h.run_all()
    assert h.result() == "long"


def test_a_lost_attempt_found_while_draining_is_retried_by_the_next_owner() -> None:
    h = Harness(_long(3))
    h.start(None)
    h.runtime.close()
    h.launches.clear()
    h.epoch += 1
    h.runtime = h._runtime(fold(h.instance_id, h.records))
    h.runtime.draining = True  # recovered in a partition that is being handed over
    out = Output()
    h.runtime.recover(out)
    h._commit(out)
    assert out.history == [] and out.launches == []
    out = h.fire()  # the lost attempt's timer fires while the partition still drains
    assert [(r.type, getattr(r, "attempt", None)) for r in out.history] == [("StepFailed", 1)]
    assert out.launches == []  # nothing starts while draining...
    assert [t.purpose for t in out.timers if isinstance(t, TimerScheduled)] == ["retry"]
    assert h.crash().history == []
    out = h.fire()  # ...the retry timer fires for the next owner, which starts it
    assert [(r.type, getattr(r, "attempt", None)) for r in out.history] == [
        ("StepAttemptStarted", 2)
    ]
    h.run_all()
    assert h.result() == "long"


def test_a_cancel_on_the_log_wins_over_a_sleep_that_fell_due_while_no_worker_ran() -> None:
    h = Harness(define("nap", _nap))
    h.start(None)
    h.clock.advance(60)  # every worker was down past the wake time; a cancel came in
    assert h.crash().history == []  # the recovery leaves the overdue sleep to its timer
    ((timer_id, fire_at),) = h.timers.items()
    cancelled = h.feed(_command(CancelWorkflow, "c-1"))
    assert [r.type for r in cancelled.history][-1] == "WorkflowCancelled"
    assert h.timers == {}  # the cancel withdrew the sleep's timer; a fire already on the
    late = TimerFired(  # log behind the cancel changes nothing
        instance_id=h.instance_id, command_id="fire:late", timer_id=timer_id, fire_at_ms=fire_at
    )
    assert h.feed(late).history == []
    assert h.state.status.value == "cancelled"


def test_a_retry_whose_fire_was_dropped_is_armed_again_by_the_next_owner() -> None:
    """A fire can be consumed without starting the retry (the instance was parked, or an
    older version's drain held it back): the next owner arms the overdue timer again."""
    h = Harness(_long(3))
    h.start(None)
    h.fail("long")
    ((timer_id, fire_at),) = h.timers.items()
    h.timers.clear()  # fired and dropped
    h.clock.advance(60)
    out = h.crash()
    assert out.history == []  # nothing decided on the clock...
    assert [(t.timer_id, t.fire_at_ms, t.purpose) for t in out.timers] == [
        (timer_id, fire_at, "retry")  # ...but the timer is armed again
    ]
    assert [(r.type, getattr(r, "attempt", None)) for r in h.fire().history] == [
        ("StepAttemptStarted", 2)
    ]
    h.run_all()
    assert h.result() == "long"


# ---- memory: a discarded runtime is freed at once ------------------------------------


async def _sleeps_in_a_branch(ctx: Context, _: Any) -> str:
    async def branch() -> None:
        await ctx.sleep("nap", 3600)

    try:
        await asyncio.gather(branch(), ctx.sleep("other", 7200))
    finally:
        pass
    return "woke"


SLEEPS_IN_A_BRANCH = define("sleeps-in-a-branch", _sleeps_in_a_branch)


@pytest.mark.parametrize("finish", [False, True], ids=["evicted-asleep", "finished"])
def test_a_discarded_runtime_is_freed_without_the_garbage_collector(finish: bool) -> None:
    """Evicting a sleeper cancels its tasks; the cancelled tasks, their errors'
    tracebacks and the loop must not hold each other in a cycle, or every eviction
    leaves a heap for the collector, whose pauses stop the engine's loop."""
    import gc
    import weakref

    gc.disable()  # from the start: a collection must not free a cycle behind our back
    try:
        h = Harness(SLEEPS_IN_A_BRANCH)
        h.start(None)
        assert h.runtime._loop is not None
        loop = weakref.ref(h.runtime._loop)
        if finish:
            h.run_all()
            assert h.result() == "woke"
        else:
            assert h.state.status is Status.RUNNING and len(h.timers) == 2
        runtime = h.runtime
        alive = weakref.ref(runtime)
        _OPEN.remove(h)
        runtime.close()
        del runtime, h
        assert alive() is None
        assert loop() is None
    finally:
        gc.enable()
