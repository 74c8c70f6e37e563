"""The runtime's side of start policies, a run's timeout and terminate: what each
records, that a restarted run is the only one replayed (a fold of the whole history is
the live state), and that the previous run's late outcomes and ids never reach it."""

from __future__ import annotations

from typing import Any

from stepstream.engine.api.context import Context
from stepstream.engine.api.retry import RetryPolicy
from stepstream.engine.api.workflow import WorkflowDefinition
from stepstream.engine.replay.effects import StepOutcome
from stepstream.engine.replay.ids import RUN_TIMEOUT_KEY
from stepstream.engine.replay.state import Status
from stepstream.engine.replay.state_json import meta_json
from stepstream.engine.wire.records import StartWorkflow, TerminateWorkflow
from tests.unit.test_runtime import CODEC, Harness, fold, ident


async def _two_steps(ctx: Context, _: Any) -> Any:
    first = await ctx.step("first", ident, 1, retry=RetryPolicy(max_attempts=3))
    return [first, await ctx.step("second", ident, 2)]


def _start(h: Harness, command_id: str, if_exists: str) -> None:
    h.feed(
        StartWorkflow(
            instance_id=h.instance_id,
            command_id=command_id,
            workflow=h.definition.name,
            input=CODEC.encode(None),
            if_exists=if_exists,
        )
    )


def _same(h: Harness) -> None:
    """The fold of every record committed is the live state (restore = live)."""
    rebuilt = fold(h.instance_id, h.records)
    assert meta_json(rebuilt) == meta_json(h.state)
    assert rebuilt.entries == h.state.entries


def test_terminate_gives_up_attempts_and_a_restart_ignores_their_late_outcome() -> None:
    h = Harness(WorkflowDefinition("two", "1", _two_steps))
    h.start()
    old = h.launch("first")
    out = h.feed(TerminateWorkflow(instance_id=h.instance_id, command_id="t-1", reason="now"))
    assert [r.type for r in out.history] == ["WorkflowTerminated"]
    assert out.cancels == [(h.instance_id, "first", 1)]
    assert h.state.status is Status.TERMINATED and h.state.cancel_reason == "now"
    h.launches.remove(old)

    _start(h, "again-1", "restart_if_failed")
    assert [r.type for r in h.records[-3:]] == [
        "WorkflowRestarted",
        "WorkflowStarted",
        "StepAttemptStarted",
    ]
    assert (h.state.status, h.state.run) == (Status.RUNNING, 2)
    # The old attempt 1's outcome (given up: cancelled) arrives now: dropped.
    late = StepOutcome(h.instance_id, "first", 1, error_type="AttemptCancelled", retryable=False)
    assert h.feed(late).history == []
    h.fail("first")  # the new run's attempt 1: a retry timer with the old run's id
    h.fire()  # applied: the previous run's fire of this id does not count as this one
    h.succeed("first", 1)
    h.succeed("second", 2)
    assert h.state.status is Status.COMPLETED
    _same(h)


def test_return_and_fail_leave_the_instance_as_it_is() -> None:
    h = Harness(WorkflowDefinition("two", "1", _two_steps))
    h.start()
    _start(h, "s-2", "return")
    _start(h, "s-3", "fail")
    ignored = [r for r in h.records if r.type == "CommandIgnored"]
    assert [r.reason for r in ignored] == [  # type: ignore[attr-defined]
        "instance already exists (status running)",
        "instance already exists (status running); if_exists=fail",
    ]
    _start(h, "s-4", "restart_if_failed")  # running: as "return"
    assert h.state.run == 1 and h.records[-1].type == "CommandIgnored"


async def _forever(ctx: Context, _: Any) -> Any:
    return await ctx.wait_for_event("never")


def test_the_timeout_entry_is_stored_replayed_and_fired() -> None:
    h = Harness(WorkflowDefinition("forever", "1", _forever, timeout=30))
    h.start()
    assert [r.type for r in h.records] == ["WorkflowStarted", "WorkflowTimeoutSet", "WaitStarted"]
    timer = h.state.entries[RUN_TIMEOUT_KEY].timer_id
    assert timer is not None and h.timers[timer] == h.records[0].time_ms + 30_000
    h.crash()  # replays: the timeout entry, visited by no code, is no divergence
    assert h.runtime.diverged is None
    out = h.fire(timer)
    assert [r.type for r in out.history] == ["WorkflowFailed"]
    failed = out.history[0]
    assert failed.error_type == "WorkflowTimeout"  # type: ignore[attr-defined]
    assert "timeout of 30 s" in failed.error_message  # type: ignore[attr-defined]
    assert h.timers == {}  # the wait's timer none, the run's fired
    _same(h)
