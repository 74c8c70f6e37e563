"""``ops.tools.replay`` on its own: histories made by driving ``InstanceRuntime`` directly (no
backend, a fake clock), then replayed against the same code and against changed code."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any

import pytest

from stepstream.engine.api.context import Context
from stepstream.engine.api.workflow import Registry, workflow
from stepstream.engine.errors import HistoryDiverged
from stepstream.engine.replay.runtime import InstanceRuntime, Output, StepLaunch, StepOutcome
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.wire.codec import JsonCodec
from stepstream.engine.wire.records import (
    CancelWorkflow,
    Command,
    HistoryRecord,
    InstanceForgotten,
    PartitionFenced,
    PauseWorkflow,
    ResumeWorkflow,
    SendEvent,
    StartWorkflow,
    TimerCancelled,
    TimerFired,
    TimerScheduled,
    WorkflowCompleted,
)
from stepstream.engine.wire.serde import default_serde
from stepstream.ops.tools.history_export import ExportedHistory
from stepstream.ops.tools.replay.replayer import replay_all, replay_history
from stepstream.ops.tools.replay.results import ReplayDiverged
from stepstream.ops.tools.replay.sources import History, fold_history_log
from stepstream.testing import replay
from tests.fakes import FakeClock

CODEC = JsonCodec()
RUNS: dict[str, int] = {}


def double(x: int) -> int:
    RUNS["double"] = RUNS.get("double", 0) + 1
    return 2 * x


def flaky(x: int) -> int:
    return x + 1


# ---- the code the histories were recorded with, and changed versions of it -----------------


@workflow("flow")
async def flow(ctx: Context, n: int) -> dict[str, Any]:
    at = ctx.now().isoformat()
    a = await ctx.step("a", double, n)
    got = await ctx.wait_for_event("go", timeout=60)
    await ctx.sleep("nap", 10)
    b = await ctx.step("b", double, a)
    return {"a": a, "b": b, "got": got, "at": at}


@workflow("flow")
async def flow_renamed(ctx: Context, n: int) -> dict[str, Any]:
    ctx.now()
    a = await ctx.step("a2", double, n)
    return {"a": a}


@workflow("flow")
async def flow_wait_became_sleep(ctx: Context, n: int) -> None:
    ctx.now()
    await ctx.step("a", double, n)
    await ctx.sleep("go", 60)


@workflow("flow")
async def flow_without_nap(ctx: Context, n: int) -> dict[str, Any]:
    at = ctx.now().isoformat()
    a = await ctx.step("a", double, n)
    got = await ctx.wait_for_event("go", timeout=60)
    b = await ctx.step("b", double, a)
    return {"a": a, "b": b, "got": got, "at": at}


@workflow("flow")
async def flow_one_more_step(ctx: Context, n: int) -> dict[str, Any]:
    at = ctx.now().isoformat()
    a = await ctx.step("a", double, n)
    got = await ctx.wait_for_event("go", timeout=60)
    await ctx.sleep("nap", 10)
    b = await ctx.step("b", double, a)
    c = await ctx.step("c", double, b)
    return {"a": a, "b": b, "c": c, "got": got, "at": at}


@workflow("flow")
async def flow_that_raises(ctx: Context, n: int) -> None:
    ctx.now()
    a = await ctx.step("a", double, n)
    await ctx.wait_for_event("go", timeout=60)
    await ctx.sleep("nap", 10)
    await ctx.step("b", double, a)
    raise ValueError("changed my mind")


@workflow("flow")
async def flow_patched_at_the_end(ctx: Context, n: int) -> dict[str, Any]:
    """``flow`` with a step added at its end behind a patch, as docs/workflows.md says
    to add one: histories recorded before the change end as they did."""
    at = ctx.now().isoformat()
    a = await ctx.step("a", double, n)
    got = await ctx.wait_for_event("go", timeout=60)
    await ctx.sleep("nap", 10)
    b = await ctx.step("b", double, a)
    if ctx.patched("notify"):
        await ctx.step("notify", double, b)
    return {"a": a, "b": b, "got": got, "at": at}


@workflow("retry")
async def retrying(ctx: Context, n: int) -> int:
    return await ctx.step("flaky", flaky, n)


def registry(*fns: Any) -> Registry:
    return Registry(fns)


# ---- making histories ------------------------------------------------------------------------


class Recorder:
    """Drives one instance the way the partition processor does and keeps its history."""

    def __init__(self, fn: Any, instance_id: str = "i-1") -> None:
        self.instance_id = instance_id
        self.clock = FakeClock()
        self.definition = Registry([fn]).resolve(fn.__stepstream_workflow__.name)
        self.runtime = InstanceRuntime(
            InstanceState(instance_id),
            self.definition,
            codec=CODEC,
            clock=self.clock,
            epoch=1,
        )
        self.records: list[HistoryRecord] = []
        self.timers: dict[str, int] = {}
        self.launches: list[StepLaunch] = []
        self._ids = itertools.count(1)

    def feed(self, msg: Command | StepOutcome) -> None:
        out = Output()
        self.runtime.handle(msg, out)
        self.records.extend(out.history)
        self.launches.extend(out.launches)
        for timer in out.timers:
            if isinstance(timer, TimerScheduled):
                self.timers[timer.timer_id] = timer.fire_at_ms
            elif isinstance(timer, TimerCancelled):
                self.timers.pop(timer.timer_id, None)
        self.clock.ms += 5

    def command(self, cls: type[Command], **attrs: Any) -> None:
        self.feed(cls(instance_id=self.instance_id, command_id=f"c-{next(self._ids)}", **attrs))

    def start(self, value: Any) -> Recorder:
        self.command(StartWorkflow, workflow=self.definition.name, input=CODEC.encode(value))
        return self

    def run(self) -> Recorder:
        """Run the oldest launched step body and deliver its result."""
        launch = self.launches.pop(0)
        value = launch.fn(*launch.args, **launch.kwargs)
        assert not inspect.isawaitable(value)
        self.feed(StepOutcome(self.instance_id, launch.key, launch.attempt, CODEC.encode(value)))
        return self

    def fail(self) -> Recorder:
        launch = self.launches.pop(0)
        self.feed(
            StepOutcome(
                self.instance_id,
                launch.key,
                launch.attempt,
                error_type="IOError",
                error_message="x",
            )
        )
        return self

    def fire(self) -> Recorder:
        timer = min(self.timers, key=lambda t: self.timers[t])
        fire_at = self.timers.pop(timer)
        self.clock.ms = max(self.clock.ms, fire_at)
        self.feed(
            TimerFired(
                instance_id=self.instance_id,
                command_id=f"fire:{timer}",
                timer_id=timer,
                fire_at_ms=fire_at,
            )
        )
        return self

    def send(self, name: str, payload: Any) -> Recorder:
        self.command(SendEvent, name=name, payload=CODEC.encode(payload))
        return self

    def history(self) -> History:
        self.runtime.close()
        return History(self.instance_id, list(self.records))


def completed_flow() -> History:
    return Recorder(flow).start(3).run().send("go", {"by": "ada"}).fire().run().history()


def waiting_flow() -> History:
    return Recorder(flow).start(3).run().history()


# ---- the tests ---------------------------------------------------------------------------------


def test_the_same_code_replays_a_completed_history_without_running_a_step() -> None:
    history = completed_flow()
    assert isinstance(history.records[-1], WorkflowCompleted)
    before = dict(RUNS)
    result = replay_history(history, registry(flow))
    assert result.outcome == "ok", result
    assert result.line() == "i-1 ok"
    assert RUNS == before, "replay ran a step body"
    assert result.result["a"] == 6 and result.result["b"] == 12
    assert result.result["got"] == {"by": "ada"}


def test_a_renamed_step_diverges_at_the_recorded_key() -> None:
    result = replay_history(completed_flow(), registry(flow_renamed))
    assert (result.outcome, result.key, result.recorded, result.reached) == (
        "diverged",
        "a",
        "step",
        "step:a2",
    )
    assert result.line() == "i-1 diverged key=a recorded=step reached=step:a2"
    assert "no longer reaches" in result.message


def test_a_wait_that_became_a_sleep_diverges_with_both_kinds() -> None:
    result = replay_history(completed_flow(), registry(flow_wait_became_sleep))
    assert (result.outcome, result.key, result.recorded, result.reached) == (
        "diverged",
        "go",
        "wait",
        "sleep:go",
    )


def test_a_removed_sleep_diverges_and_says_the_code_ended_instead() -> None:
    result = replay_history(completed_flow(), registry(flow_without_nap))
    assert (result.outcome, result.key, result.recorded, result.reached) == (
        "diverged",
        "nap",
        "sleep",
        "end:returned",
    )


def test_a_new_step_at_the_frontier_is_where_a_running_instance_goes_on() -> None:
    result = replay_history(waiting_flow(), registry(flow_one_more_step))
    assert result.outcome == "ok", result
    # ...but a finished history must end the way it ended.
    result = replay_history(completed_flow(), registry(flow_one_more_step))
    assert (result.outcome, result.key, result.recorded, result.reached) == (
        "diverged",
        "c",
        "completed",
        "step:c",
    )


def test_a_patch_after_the_last_call_replays_a_finished_history_the_old_way() -> None:
    result = replay_history(completed_flow(), registry(flow_patched_at_the_end))
    assert result.outcome == "ok", result
    assert result.result["b"] == 12
    result = replay_history(waiting_flow(), registry(flow_patched_at_the_end))
    assert result.outcome == "ok", result


def test_a_completed_history_whose_code_now_raises_diverges_at_its_end() -> None:
    result = replay_history(completed_flow(), registry(flow_that_raises))
    assert (result.outcome, result.key, result.recorded, result.reached) == (
        "diverged",
        "(end)",
        "completed",
        "failed:ValueError",
    )


def test_paused_resumed_and_cancelled_histories_replay() -> None:
    recorder = Recorder(flow).start(3).run()
    recorder.command(PauseWorkflow)
    recorder.send("go", 1)  # buffered while paused
    recorder.command(ResumeWorkflow)
    assert replay_history(recorder.history(), registry(flow)).outcome == "ok"

    recorder = Recorder(flow).start(3).run()
    recorder.command(CancelWorkflow, reason="no")
    assert replay_history(recorder.history(), registry(flow)).outcome == "ok"
    assert replay_history(recorder.history(), registry(flow_renamed)).outcome == "diverged"


def test_a_retried_step_replays() -> None:
    history = Recorder(retrying).start(1).fail().fire().run().history()
    result = replay_history(history, registry(retrying))
    assert result.outcome == "ok" and result.result == 2


def test_until_seq_replays_the_first_records_and_the_trace_shows_what_the_code_saw() -> None:
    history = completed_flow()
    result = replay_history(history, registry(flow), trace=True)
    seen = [(s.kind, s.key, s.saw) for s in result.trace]
    assert seen[0][:2] == ("value", "now#1") and seen[0][2].isdigit()  # recorded ms
    assert seen[1:] == [
        ("step", "a", "6"),
        ("wait", "go", '{"by": "ada"}'),
        ("sleep", "nap", "elapsed"),
        ("step", "b", "12"),
    ]
    assert [s.seq for s in result.trace] == sorted(s.seq or 0 for s in result.trace)
    assert all(s.seq is not None for s in result.trace)

    # Time travel: as the instance stood after its first step.
    first_step_done = next(r.seq for r in history.records if r.type == "StepSucceeded")
    result = replay_history(history, registry(flow), until_seq=first_step_done, trace=True)
    assert result.outcome == "ok" and result.records == first_step_done
    assert [(s.kind, s.key) for s in result.trace] == [
        ("value", "now#1"),
        ("step", "a"),
        ("wait", "go"),
    ]
    assert result.trace[1].saw == "6"
    assert result.trace[2].seq is None and "goes on from here" in result.trace[2].saw


def test_a_version_the_code_lacks_is_missing_and_fails() -> None:
    result = replay_history(completed_flow(), registry(retrying))
    assert result.outcome == "missing" and not result.ok
    assert "unknown workflow 'flow'" in result.message


def test_a_history_read_from_its_middle_is_skipped() -> None:
    history = completed_flow()
    result = replay_history(History("i-1", history.records[3:]), registry(flow))
    assert result.outcome == "skipped" and result.ok
    assert "starts at seq 4" in result.message


def test_replay_all_counts_and_filters_by_workflow() -> None:
    histories = [completed_flow(), Recorder(retrying, "r-1").start(1).run().history()]
    seen: list[str] = []
    summary = replay_all(
        histories, registry(flow_renamed, retrying), on_result=lambda r: seen.append(r.line())
    )
    assert summary.counts == {"diverged": 1, "ok": 1} and summary.failed == 1
    assert seen[1] == "r-1 ok"
    summary = replay_all(histories, registry(flow_renamed, retrying), workflow="retry")
    assert summary.counts == {"ok": 1}


def test_keys_with_spaces_are_quoted_in_the_line() -> None:
    result = replay_history(completed_flow(), registry(flow))
    odd = dataclasses.replace(
        result, outcome="diverged", key="a b", recorded="step", reached="step:x"
    )
    assert odd.line() == 'i-1 diverged key="a b" recorded=step reached=step:x'


def test_testing_replay_raises_history_diverged_with_the_key() -> None:
    history = completed_flow()
    exported = ExportedHistory("i-1", "flow", "1", history.records)
    assert replay(exported, [flow]).result["b"] == 12
    with pytest.raises(HistoryDiverged) as caught:
        replay(exported, flow_renamed)
    assert isinstance(caught.value, ReplayDiverged)
    assert (caught.value.key, caught.value.recorded, caught.value.reached) == (
        "a",
        "step",
        "step:a2",
    )


def test_the_history_log_is_folded_by_the_reader_rules() -> None:
    serde = default_serde()
    story = completed_flow().records
    fence = PartitionFenced(instance_id="", epoch=5, partition=0)
    stale = dataclasses.replace(story[1], seq=99, epoch=1)
    forgotten = InstanceForgotten(instance_id="i-1", seq=len(story) + 1, finished_ms=1)
    again = Recorder(flow, "i-1").start(4).history().records
    raw = [
        *[(0, serde.encode(r)) for r in story[:3]],
        (0, serde.encode(story[1])),  # re-delivered
        *[(0, serde.encode(r)) for r in story[3:]],
        (0, b"not a record"),
        (0, serde.encode(fence)),
        (0, serde.encode(stale)),  # written by a deposed owner after the fence
    ]
    folded, unreadable = fold_history_log(raw, serde)
    assert unreadable == 1
    assert [h.records for h in folded] == [story]

    raw += [(0, serde.encode(_with_epoch(forgotten, 5)))]
    raw += [(0, serde.encode(_with_epoch(r, 5))) for r in again]
    folded, _ = fold_history_log(raw, serde)
    assert [[r.seq for r in h.records] for h in folded] == [[r.seq for r in again]]


def _with_epoch(record: HistoryRecord, epoch: int) -> HistoryRecord:
    return dataclasses.replace(record, epoch=epoch)
