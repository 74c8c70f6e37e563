"""The workflow API and instance lifecycle, end to end on each backend."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from stepstream import (
    InstanceFinished,
    InstanceNotPaused,
    InvalidPayload,
    PayloadTooLarge,
    ResultTimeout,
    UnknownInstance,
    UnknownWorkflow,
    WorkflowCancelled,
    WorkflowFailed,
)
from stepstream.producers.client import Client
from tests.workflows import RUNS, ledger_count


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def run(client: Client, workflow: str, arg: Any, timeout: float = 20) -> Any:
    instance = await client.start(workflow, arg, instance_id=new_id(workflow))
    try:
        return await client.result(instance, timeout=timeout)
    except Exception:
        history = await client.history(instance)
        print(f"history of {instance}:", *[(h.seq, h.type, h.attributes) for h in history])
        raise


async def types_of(client: Client, instance: str) -> list[str]:
    return [h.type for h in await client.history(instance)]


async def test_sync_and_async_steps(client: Client) -> None:
    assert await run(client, "arith", 4) == {"total": 5, "doubled": 10}


async def test_many_sequential_steps(client: Client) -> None:
    assert await run(client, "chain", 25) == 25


async def test_live_instances_are_cached_not_replayed(client: Client) -> None:
    """Each step and the timer resume the cached coroutine: the code starts once."""
    instance = await client.start("counted", 20, instance_id=new_id("cached"))
    assert await client.result(instance, timeout=20) == 20
    assert RUNS[instance] == 1


async def test_retries_then_success(client: Client) -> None:
    key = new_id("k")
    result = await run(client, "retrying", {"key": key, "fail": 2, "max": 5})
    assert result == "ok after 3"


async def test_step_bodies_see_their_attempt_number(client: Client) -> None:
    assert await run(client, "attempt-aware", 3) == {"sync": 3, "async": 3, "outside": 0}


async def test_step_failed_is_catchable_after_last_attempt(client: Client) -> None:
    key = new_id("k")
    result = await run(client, "retrying", {"key": key, "fail": 10, "max": 3})
    assert result == "compensated: 3 attempts, RuntimeError"


async def test_non_retryable_fails_at_once(client: Client) -> None:
    instance = await client.start("fatal", None, instance_id=new_id("fatal"))
    with pytest.raises(WorkflowFailed, match="card declined"):
        await client.result(instance, timeout=10)
    attempts = [h for h in await client.history(instance) if h.type == "StepAttemptStarted"]
    assert len(attempts) == 1


async def test_step_timeout_counts_as_failed_attempt(client: Client) -> None:
    instance = await client.start("timeout", 1.0, instance_id=new_id("timeout"))
    with pytest.raises(WorkflowFailed, match="StepTimeout"):
        await client.result(instance, timeout=10)
    failures = [h for h in await client.history(instance) if h.type == "StepFailed"]
    assert [f.attributes["error_type"] for f in failures] == ["StepTimeout", "StepTimeout"]


async def test_sleep_is_durable_and_not_early(client: Client) -> None:
    result = await run(client, "sleeper", 0.3)
    assert result["slept"] >= 0.3


async def test_sleep_until(client: Client) -> None:
    assert await run(client, "sleep-until", 0.2) == "woke"


async def test_wait_for_event_delivered(client: Client) -> None:
    instance = await client.start("waiter", None, instance_id=new_id("wait"))
    await wait_for_status(client, instance, lambda s: any(w.kind == "wait" for w in s.waits))
    await client.send_event(instance, "approval", {"by": "ada"})
    assert await client.result(instance, timeout=10) == {"by": "ada"}


async def test_wait_for_event_times_out(client: Client) -> None:
    assert await run(client, "waiter", 0.2) == "timed out"


async def test_events_sent_early_are_buffered_in_order(client: Client) -> None:
    instance = new_id("two")
    await client.start("two-events", None, instance_id=instance)
    # Both events may arrive before either wait; each wait claims one, in arrival order.
    await client.send_event(instance, "item", 1)
    await client.send_event(instance, "item", 2)
    assert await client.result(instance, timeout=10) == [1, 2]


async def test_events_sent_before_any_wait_are_buffered_and_claimed_in_order(
    client: Client,
) -> None:
    instance = await client.start("late-waits", 0.5, instance_id=new_id("late"))
    for n in (1, 2, 3):
        await client.send_event(instance, "item", n)
    assert (await client.status(instance)).buffered_events == 3
    assert await client.result(instance, timeout=10) == [1, 2]
    history = await client.history(instance)
    assert [h.type for h in history].count("EventBuffered") == 3
    claimed = [h.attributes["event_command_id"] for h in history if h.type == "WaitSatisfied"]
    buffered = [h.command_id for h in history if h.type == "EventBuffered"]
    assert claimed == buffered[:2]  # each claimed once, in order of arrival


async def test_two_instances_may_use_one_event_id(client: Client) -> None:
    """An event id makes a retried send apply once on its instance; another instance may
    use the same id, and each send is answered with its own outcome, not the other's."""
    done = await client.start("arith", 1, instance_id=new_id("done"))
    await client.result(done, timeout=10)
    with pytest.raises(InstanceFinished, match="already completed"):
        await client.send_event(done, "approval", 1, event_id="order-7")
    live = await client.start("waiter", None, instance_id=new_id("wait"))
    await client.send_event(live, "approval", 2, event_id="order-7")  # not the refusal
    assert await client.result(live, timeout=10) == 2

    other = await client.start("waiter", None, instance_id=new_id("wait"))
    await client.send_event(other, "approval", 3, event_id="order-8")
    assert await client.result(other, timeout=10) == 3
    with pytest.raises(InstanceFinished, match="already completed"):  # not "applied"
        await client.send_event(done, "approval", 4, event_id="order-8")


async def test_event_for_other_name_stays_buffered(client: Client) -> None:
    instance = await client.start("waiter", None, instance_id=new_id("wait"))
    await client.send_event(instance, "unrelated", 1)
    await client.send_event(instance, "approval", 2)
    assert await client.result(instance, timeout=10) == 2
    status = await client.status(instance)
    assert status.buffered_events == 1


async def test_parallel_steps_with_gather(client: Client) -> None:
    assert await run(client, "parallel", 8) == [100 + i for i in range(8)]


async def test_now_uuid_random_recorded(client: Client) -> None:
    instance = await client.start("values", None, instance_id=new_id("values"))
    result = await client.result(instance, timeout=10)
    recorded = {
        h.attributes["kind"]: h.attributes["value"]
        for h in await client.history(instance)
        if h.type == "ValueRecorded"
    }
    assert recorded["uuid"] == result["uuid"]
    assert recorded["random"] == result["random"]


async def test_names_repeat_in_loops_and_replay_the_same(client: Client) -> None:
    """A loop that reuses a step name and waits for the same event each time: every use
    is its own key, and a pause/resume (a replay from history) reaches the same state."""
    instance = await client.start("reuse", 2, instance_id=new_id("reuse"))
    await client.send_event(instance, "item", "a")
    await client.pause(instance)
    await client.resume(instance)
    await client.send_event(instance, "item", "b")
    assert await client.result(instance, timeout=20) == [1, "a", 2, "b", 101]
    history = await client.history(instance)
    succeeded = [h.attributes["key"] for h in history if h.type == "StepSucceeded"]
    assert succeeded == ["same", "same#2", "tail/same"]
    waits = [h.attributes["key"] for h in history if h.type == "WaitSatisfied"]
    assert waits == ["item", "item#2"]


async def test_unencodable_step_result_fails_step_with_message(client: Client) -> None:
    instance = await client.start("bad-result", None, instance_id=new_id("bad"))
    with pytest.raises(WorkflowFailed, match="not JSON-encodable"):
        await client.result(instance, timeout=10)


async def test_oversized_workflow_result_fails_the_instance(client: Client) -> None:
    """The limit that guards inputs and step results guards the workflow's own result."""
    instance = await client.start("big-result", 2 * 1024 * 1024, instance_id=new_id("big"))
    with pytest.raises(WorkflowFailed, match="over the limit") as failed:
        await client.result(instance, timeout=20)
    assert failed.value.error_type == "PayloadTooLarge"


async def test_huge_error_messages_are_cut(client: Client) -> None:
    """An exception's text is recorded, but cut to a size any broker accepts."""
    result = await run(client, "loud-failure", 3 * 1024 * 1024)
    assert result.startswith("caught ") and int(result.split()[1]) < 10_000
    instance = await client.start("loud-failure", 50_000, instance_id=new_id("loud"))
    await client.result(instance, timeout=20)
    [failed] = [h for h in await client.history(instance) if h.type == "StepFailed"]
    message = failed.attributes["error_message"]
    assert message.startswith("!" * 100) and message.endswith("more characters cut]")
    assert len(message) < 10_000


async def test_overlong_cancel_reason_is_rejected_at_the_client(client: Client) -> None:
    instance = await client.start("waiter", None, instance_id=new_id("reason"))
    with pytest.raises(PayloadTooLarge, match="cancel reason"):
        await client.cancel(instance, reason="why" * 10_000)
    assert (await client.status(instance)).status == "running"


async def test_workflow_exception_fails_instance(client: Client) -> None:
    instance = await client.start("boom", None, instance_id=new_id("boom"))
    with pytest.raises(WorkflowFailed, match="ValueError: workflow code raised"):
        await client.result(instance, timeout=10)
    assert (await client.status(instance)).status == "failed"


async def test_start_is_idempotent_on_instance_id(client: Client) -> None:
    instance = new_id("idem")
    assert await client.start("arith", 1, instance_id=instance) == instance
    assert await client.start("arith", 100, instance_id=instance) == instance
    assert await client.result(instance, timeout=10) == {"total": 2, "doubled": 4}
    assert (await types_of(client, instance)).count("WorkflowStarted") == 1


async def test_cancel_with_reason(client: Client) -> None:
    instance = await client.start("waiter", None, instance_id=new_id("cancel"))
    await client.cancel(instance, reason="customer changed their mind")
    with pytest.raises(WorkflowCancelled, match="customer changed their mind"):
        await client.result(instance, timeout=10)
    status = await client.status(instance)
    assert status.status == "cancelled"
    assert status.waits == []  # the wait it was in ended with it


async def test_pause_and_resume(client: Client, ledger: Path) -> None:
    name = new_id("gate")
    instance = await client.start("gated", name, instance_id=name)
    await wait_for_status(client, instance, lambda s: any(w.kind == "wait" for w in s.waits))
    with pytest.raises(InstanceNotPaused, match="is running, not paused"):
        await client.resume(instance)
    await client.pause(instance)
    assert (await client.status(instance)).status == "paused"
    await client.pause(instance)  # pausing is idempotent
    await client.send_event(instance, "go", "green")
    await asyncio.sleep(0.2)
    # The event is recorded while paused, but the code does not move on.
    assert ledger_count(ledger, f"{name}-after") == 0
    assert (await client.status(instance)).status == "paused"
    await client.resume(instance)
    assert await client.result(instance, timeout=10) == [f"{name}-before", "green", f"{name}-after"]
    assert ledger_count(ledger, f"{name}-before") == 1
    ignored = [h.attributes for h in await client.history(instance) if h.type == "CommandIgnored"]
    assert [i["command_type"] for i in ignored] == ["ResumeWorkflow", "PauseWorkflow"]


async def test_commands_for_finished_instance_are_rejected(client: Client) -> None:
    instance = await client.start("arith", 1, instance_id=new_id("done"))
    await client.result(instance, timeout=10)
    for action in (
        client.cancel(instance),
        client.pause(instance),
        client.resume(instance),
        client.send_event(instance, "late", 1),
    ):
        with pytest.raises(InstanceFinished, match="already completed"):
            await action
    assert (await client.status(instance)).status == "completed"
    # Recorded and ignored, in the order they were sent.
    ignored = [h.attributes for h in await client.history(instance) if h.type == "CommandIgnored"]
    assert [i["command_type"] for i in ignored] == [
        "CancelWorkflow",
        "PauseWorkflow",
        "ResumeWorkflow",
        "SendEvent",
    ]


async def test_status_lifecycle_fields(client: Client) -> None:
    instance = await client.start("waiter", None, instance_id=new_id("st"))
    status = await client.status(instance)
    assert status.status == "running"
    assert status.workflow == "waiter" and status.version == "1"
    assert status.created_at and status.updated_at
    assert [w.event for w in status.waits] == ["approval"]
    listed = await client.list(status="running")
    assert instance in [s.instance_id for s in listed]


async def test_history_records_are_ordered(client: Client) -> None:
    instance = await client.start("arith", 2, instance_id=new_id("hist"))
    await client.result(instance, timeout=10)
    history = await client.history(instance)
    assert [h.seq for h in history] == list(range(1, len(history) + 1))
    assert [h.type for h in history] == [
        "WorkflowStarted",
        "StepAttemptStarted",
        "StepSucceeded",
        "StepAttemptStarted",
        "StepSucceeded",
        "WorkflowCompleted",
    ]


# ---- bad input ------------------------------------------------------------------------


async def test_unknown_workflow_rejected(client: Client) -> None:
    with pytest.raises(UnknownWorkflow, match="nope"):
        await client.start("nope", {})
    assert await client.list() == []


async def test_unencodable_input_rejected(client: Client) -> None:
    with pytest.raises(InvalidPayload, match="not JSON-encodable"):
        await client.start("arith", {"x": object()})
    assert await client.list() == []


async def test_oversized_payload_rejected(client: Client) -> None:
    with pytest.raises(PayloadTooLarge, match="over the limit"):
        await client.start("arith", "x" * (1024 * 1024 + 1))
    instance = await client.start("waiter", None, instance_id=new_id("big"))
    with pytest.raises(PayloadTooLarge):
        await client.send_event(instance, "approval", "x" * (1024 * 1024 + 1))
    assert (await client.status(instance)).status == "running"


async def test_commands_for_unknown_instance_rejected(client: Client) -> None:
    for action in (
        client.send_event("ghost", "approval", 1),
        client.cancel("ghost"),
        client.status("ghost"),
        client.history("ghost"),
    ):
        with pytest.raises(UnknownInstance, match="ghost"):
            await action


async def wait_for_status(
    client: Client, instance: str, predicate: Any, timeout: float = 10
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        status = await client.status(instance)
        if predicate(status):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{instance} never reached the expected state: {status}")
        await asyncio.sleep(0.02)


async def test_race_winner_is_recorded_and_a_withdrawn_wait_takes_no_event(
    client: Client,
) -> None:
    instance = await client.start("race-events", 3600, instance_id=new_id("race"))
    await client.send_event(instance, "reject", "no")  # wins the race
    await client.pause(instance)  # replay from history: the same winner
    await client.resume(instance)
    await client.send_event(instance, "approve", "yes")  # for the later wait only
    assert await client.result(instance, timeout=20) == ["rejected", "no", "yes"]
    history = await client.history(instance)
    [decided] = [h.attributes for h in history if h.type == "RaceDecided"]
    assert decided["winner"] == "rejected"
    satisfied = [h.attributes["key"] for h in history if h.type == "WaitSatisfied"]
    assert satisfied == ["race/rejected/reject", "approve"]


async def test_a_race_lost_to_a_deadline(client: Client) -> None:
    instance = await client.start("race-events", 0.2, instance_id=new_id("race"))
    await asyncio.sleep(0.5)
    await client.send_event(instance, "approve", "too late")
    assert await client.result(instance, timeout=20) == ["expired", None, "too late"]


async def test_join_runs_branches_in_their_own_scopes(client: Client) -> None:
    instance = await client.start("join-parts", ["ab", "cde"], instance_id=new_id("join"))
    assert await client.result(instance, timeout=20) == {"ab": [2, 2], "cde": [3, 2]}
    keys = [
        h.attributes["key"] for h in await client.history(instance) if h.type == "StepSucceeded"
    ]
    assert sorted(keys) == [
        "join/ab/fetch",
        "join/ab/fetch#2",
        "join/cde/fetch",
        "join/cde/fetch#2",
    ]


async def test_a_loop_carries_state_replays_from_its_last_iteration_and_prunes(
    client: Client,
) -> None:
    args = {"n": 40, "pause_at": 20, "keep": 3}
    instance = await client.start("polling", args, instance_id=new_id("poll"))
    for _ in range(500):
        if (await client.status(instance)).waits:
            break
        await asyncio.sleep(0.01)
    await client.pause(instance)  # the replay on resume starts at iteration 19
    await client.resume(instance)
    await client.send_event(instance, "go-on", None)
    assert await client.result(instance, timeout=30) == 40
    history = await client.history(instance)
    ticks = [h.attributes["key"] for h in history if h.type == "StepSucceeded"]
    assert ticks == ["poll/36/tick", "poll/37/tick", "poll/38/tick", "poll/39/tick"]
    assert len(history) < 25, [h.type for h in history]  # 40 iterations, bounded


async def test_a_saga_rolls_back_newest_first(client: Client) -> None:
    from tests.workflows import BOOKED

    BOOKED.clear()
    instance = await client.start("trip", True, instance_id=new_id("trip"))
    await client.send_event(instance, "payment-failed", None)
    assert await client.result(instance, timeout=20) == "rolled back: payment failed"
    assert BOOKED == ["book flight", "book hotel", "cancel hotel-1", "cancel flight-1"]
    keys = [
        h.attributes["key"] for h in await client.history(instance) if h.type == "StepSucceeded"
    ]
    assert keys == [
        "booking/flight",
        "booking/hotel",
        "booking/hotel/undo",
        "booking/flight/undo",
    ]


async def test_child_workflows_run_anywhere_and_report_back(client: Client) -> None:
    instance = new_id("parent")
    await client.start("parent", {"n": 5}, instance_id=instance)
    assert await client.result(instance, timeout=30) == [
        {"kid": f"{instance}/kid", "doubled": 10},
        {"kid": f"{instance}/kid#2", "doubled": 12},
        "failed",
        "StepFailed",
    ]
    for child in (f"{instance}/kid", f"{instance}/kid#2", f"{instance}-bad"):
        assert (await client.status(child)).status in ("completed", "failed")


async def test_a_paused_and_resumed_parent_still_gets_its_childs_result(client: Client) -> None:
    instance = new_id("parent")
    await client.start("parent", {"n": 1, "wait": True}, instance_id=instance)
    child = f"{instance}/kid#2"
    for _ in range(500):
        try:
            if (await client.status(child)).waits:
                break
        except UnknownInstance:
            pass
        await asyncio.sleep(0.01)
    await client.pause(instance)
    await client.send_event(child, "kid-go", None)  # finishes while the parent is paused
    await client.result(child, timeout=20)
    await client.resume(instance)
    result = await client.result(instance, timeout=30)
    assert result[1] == {"kid": child, "doubled": 4}


async def test_cancelling_a_parent_cancels_the_children_it_waits_for(client: Client) -> None:
    instance = new_id("parent")
    await client.start("parent", {"n": 1, "wait": True}, instance_id=instance)
    child = f"{instance}/kid#2"
    for _ in range(500):
        try:
            if (await client.status(child)).waits:
                break
        except UnknownInstance:
            pass
        await asyncio.sleep(0.01)
    await client.cancel(instance, reason="changed my mind")
    with pytest.raises(WorkflowCancelled, match=f"its parent {instance} was cancelled"):
        await client.result(child, timeout=20)


async def test_clients_may_not_send_the_engine_s_own_events(client: Client) -> None:
    instance = await client.start("waiter", None, instance_id=new_id("tilde"))
    with pytest.raises(InvalidPayload, match="reserved"):
        await client.send_event(instance, "~child/kid", {"status": "completed"})


async def test_messages_queue_in_arrival_order_and_go_to_other_instances_once(
    client: Client,
) -> None:
    listener = await client.start("waiter", None, instance_id=new_id("listener"))
    box = new_id("box")
    await client.start("mailbox", {"count": 4, "notify": listener}, instance_id=box)
    for item in ("a", "b"):
        await client.send_event(box, "line", item)
    await client.pause(box)  # held while paused, taken in order after
    await client.send_event(box, "urgent", "c")
    await client.send_event(box, "line", "d")
    await client.resume(box)
    assert await client.result(box, timeout=20) == [
        ["line", "a"],
        ["line", "b"],
        ["urgent", "c"],
        ["line", "d"],
    ]
    # The tally reaches the other instance's wait exactly once ("waiter" waits for
    # "approval": it is buffered there, so count the buffered events).
    for _ in range(500):
        status = await client.status(listener)
        if status.buffered_events:
            break
        await asyncio.sleep(0.01)
    assert status.buffered_events == 1
    tally = [h for h in await client.history(listener) if h.type == "EventBuffered"]
    assert [(h.attributes["event_name"], h.attributes["payload"]) for h in tally] == [("tally", 4)]
    types = [h.type for h in await client.history(box)]
    assert types.count("MessageSent") == 1 and types.count("MessageCompleted") == 4


async def test_request_gets_the_answer_the_workflow_completes_the_message_with(
    client: Client,
) -> None:
    instance = await client.start("quoter", None, instance_id=new_id("quoter"))
    answers = await asyncio.gather(
        *(client.request(instance, "quote", {"qty": n}, timeout=20) for n in (1, 2, 3))
    )
    assert sorted(a["price"] for a in answers) == [3, 6, 9]
    with pytest.raises(ResultTimeout):
        await client.request(instance, "unheard", None, timeout=0.3)
    await client.send_event(instance, "stop", None, event_id="stop-1")
    await client.send_event(instance, "stop", None, event_id="stop-1")  # applied once
    assert await client.result(instance, timeout=20) == 3
    types = [h.type for h in await client.history(instance)]
    assert types.count("MessageCompleted") == 3


async def test_a_request_the_instance_ends_without_answering_is_told_so(
    client: Client,
) -> None:
    """A request waits for its answer only while one can come: once the instance ends
    without answering (it took the message and returned, or never took it), the asker
    is told at once, not at the end of its timeout."""
    instance = await client.start("quoter", None, instance_id=new_id("quoter"))
    unheard = asyncio.ensure_future(client.request(instance, "unheard", None, timeout=60))
    await asyncio.sleep(0.2)
    began = time.monotonic()
    with pytest.raises(InstanceFinished, match="ended \\(completed\\) without answering"):
        await client.request(instance, "stop", None, timeout=60)
    with pytest.raises(InstanceFinished, match=f"instance {instance} ended"):
        await unheard
    assert time.monotonic() - began < 30  # told, not timed out
    assert await client.result(instance, timeout=20) == 0
    with pytest.raises(InstanceFinished):  # and so is a request that comes after the end
        await client.request(instance, "quote", {"qty": 1}, timeout=60)


async def test_ephemeral_steps_record_only_their_results(client: Client) -> None:
    instance = await client.start("ephemeral", 5, instance_id=new_id("eph"))
    assert await client.result(instance, timeout=20) == 10
    types = [h.type for h in await client.history(instance)]
    assert types.count("StepSucceeded") == 5 and "StepAttemptStarted" not in types


async def test_a_child_whose_workflow_is_not_deployed_fails_in_its_parent(
    client: Client,
) -> None:
    instance = await client.start("orphan-parent", None, instance_id=new_id("orphan"))
    assert await client.result(instance, timeout=20) == ["failed", "UnknownWorkflow"]


async def test_a_child_id_that_exists_fails_the_parents_call_at_once(client: Client) -> None:
    taken = await client.start("waiter", None, instance_id=new_id("taken"))
    instance = await client.start("adopter", taken, instance_id=new_id("adopter"))
    status, error_type, child_id, message = await client.result(instance, timeout=20)
    assert (status, error_type, child_id) == ("failed", "InstanceExists", taken)
    assert f"instance {taken} already exists (workflow waiter, status running)" in message
    # The instance that held the id goes on untouched: the parent's start is ignored there.
    assert (await client.status(taken)).status == "running"
    assert "CommandIgnored" in await types_of(client, taken)


async def test_a_race_cancels_the_children_of_its_losing_branches(client: Client) -> None:
    instance = await client.start("racing-parent", None, instance_id=new_id("racer"))
    assert await client.result(instance, timeout=20) == ["beat", "beat"]
    (started,) = [h for h in await client.history(instance) if h.type == "ChildStarted"]
    child = started.attributes["child_id"]
    with pytest.raises(WorkflowCancelled, match="losing branch of race"):
        await client.result(child, timeout=20)
