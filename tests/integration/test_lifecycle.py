"""Start policies, a run's timeout and terminate, through the public client, on each
backend (the ``client`` fixture runs every test embedded and on Kafka)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from stepstream import (
    Client,
    InstanceExists,
    InstanceFinished,
    InvalidPayload,
    WorkflowCancelled,
    WorkflowFailed,
    WorkflowTerminated,
    WorkflowTimeout,
)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def history_of(client: Client, instance: str) -> list[tuple[int, str, dict[str, Any]]]:
    return [(h.seq, h.type, h.attributes) for h in await client.history(instance)]


async def until(what: Callable[[], Awaitable[bool]], timeout: float = 20) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await what():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def fail_once(client: Client, instance: str) -> None:
    await client.start("flaky-once", {"fail": True}, instance_id=instance)
    with pytest.raises(WorkflowFailed, match="on purpose"):
        await client.result(instance, timeout=20)


# ---- if_exists -------------------------------------------------------------------------


async def test_return_is_the_default_and_keeps_the_first_run(client: Client) -> None:
    instance = new_id("ret")
    await fail_once(client, instance)
    assert await client.start("flaky-once", {"n": 1}, instance_id=instance) == instance
    assert await client.start("flaky-once", {"n": 1}, instance_id=instance, if_exists="return")
    with pytest.raises(WorkflowFailed):
        await client.result(instance, timeout=5)
    assert (await client.status(instance)).run == 1
    # The policy looks at the id only; the history says when a start named another workflow.
    assert await client.start("arith", 1, instance_id=instance) == instance
    ignored = [a for _, t, a in await history_of(client, instance) if t == "CommandIgnored"]
    assert "workflow 'flaky-once', not 'arith'" in ignored[-1]["reason"], ignored
    assert (await client.status(instance)).workflow == "flaky-once"


async def test_fail_raises_instance_exists_naming_the_id_and_status(client: Client) -> None:
    instance = new_id("fail")
    await client.start("flaky-once", {"wait": True}, instance_id=instance)
    with pytest.raises(
        InstanceExists, match=rf"{instance} already exists \(status (running|pending)\)"
    ) as err:
        await client.start("flaky-once", {}, instance_id=instance, if_exists="fail")
    assert err.value.instance_id == instance
    assert err.value.status in ("running", "pending")
    # Refused and recorded; the instance goes on as it was.
    await client.send_event(instance, "go", None)
    assert await client.result(instance, timeout=20) == {"ok": 0}
    ignored = [a for _, t, a in await history_of(client, instance) if t == "CommandIgnored"]
    assert [a["command_type"] for a in ignored] == ["StartWorkflow"]
    assert "if_exists=fail" in ignored[0]["reason"]
    with pytest.raises(InstanceExists, match="status completed"):
        await client.start("flaky-once", {}, instance_id=instance, if_exists="fail")


async def test_fail_starts_a_new_id_as_usual(client: Client) -> None:
    instance = new_id("fresh")
    await client.start("flaky-once", {"n": 3}, instance_id=instance, if_exists="fail")
    assert await client.result(instance, timeout=20) == {"ok": 3}


async def test_restart_if_failed_runs_a_failed_instance_afresh(client: Client) -> None:
    instance = new_id("again")
    await fail_once(client, instance)
    await client.start("flaky-once", {"n": 7}, instance_id=instance, if_exists="restart_if_failed")
    assert await client.result(instance, timeout=20) == {"ok": 7}
    status = await client.status(instance)
    assert (status.status, status.run, status.error) == ("completed", 2, None)
    types = [t for _, t, _ in await history_of(client, instance)]
    # The first run's records stay, then the restart, then the second run.
    assert types[0] == "WorkflowStarted" and "WorkflowFailed" in types
    restart = types.index("WorkflowRestarted")
    assert types.index("WorkflowFailed") < restart
    assert types[restart + 1] == "WorkflowStarted" and types[-1] == "WorkflowCompleted"
    (attrs,) = [a for _, t, a in await history_of(client, instance) if t == "WorkflowRestarted"]
    assert attrs == {"run": 2, "previous_status": "failed"}
    # A completed instance is kept as it is, as with "return".
    await client.start("flaky-once", {"n": 8}, instance_id=instance, if_exists="restart_if_failed")
    assert await client.result(instance, timeout=5) == {"ok": 7}
    assert (await client.status(instance)).run == 2


async def test_restart_if_failed_restarts_cancelled_and_keeps_running(client: Client) -> None:
    instance = new_id("cxl")
    await client.start("flaky-once", {"wait": True}, instance_id=instance)
    # Running: returned as it is.
    await client.start("flaky-once", {"n": 1}, instance_id=instance, if_exists="restart_if_failed")
    assert (await client.status(instance)).run == 1
    await client.cancel(instance, reason="by hand")
    with pytest.raises(WorkflowCancelled):
        await client.result(instance, timeout=20)
    await client.start("flaky-once", {"n": 2}, instance_id=instance, if_exists="restart_if_failed")
    assert await client.result(instance, timeout=20) == {"ok": 2}


async def test_two_clients_restarting_at_once_start_one_new_run(client: Client) -> None:
    """The owner decides each start against the state it owns: the second restart finds
    the new run going and is returned as with "return"."""
    instance = new_id("race")
    await fail_once(client, instance)
    again = {"wait": True}
    await asyncio.gather(
        *(
            client.start("flaky-once", again, instance_id=instance, if_exists="restart_if_failed")
            for _ in range(4)
        )
    )
    await client.send_event(instance, "go", None)
    assert await client.result(instance, timeout=20) == {"ok": 0}
    types = [t for _, t, _ in await history_of(client, instance)]
    assert types.count("WorkflowRestarted") == 1 and types.count("CommandIgnored") == 3
    assert (await client.status(instance)).run == 2


async def test_if_exists_must_be_a_policy(client: Client) -> None:
    with pytest.raises(InvalidPayload, match="restart_if_failed"):
        await client.start("flaky-once", {}, instance_id=new_id("bad"), if_exists="replace")


# ---- timeout ---------------------------------------------------------------------------


async def test_a_run_past_its_timeout_fails_with_workflow_timeout(client: Client) -> None:
    instance = await client.start("deadline", {"wait": True}, instance_id=new_id("late"))
    with pytest.raises(
        WorkflowTimeout, match=r"did not finish within its timeout of 1\.5 s"
    ) as err:
        await client.result(instance, timeout=20)
    assert isinstance(err.value, WorkflowFailed) and err.value.error_type == "WorkflowTimeout"
    status = await client.status(instance)
    assert status.status == "failed"
    assert (status.error or "").startswith("WorkflowTimeout:")
    types = [t for _, t, _ in await history_of(client, instance)]
    assert types[:3] == ["WorkflowStarted", "WorkflowTimeoutSet", "WaitStarted"]
    assert types[-1] == "WorkflowFailed"


async def test_a_timeout_gives_up_a_running_step(client: Client) -> None:
    instance = await client.start("deadline", {"hang_step": True}, instance_id=new_id("hang"))
    with pytest.raises(WorkflowTimeout):
        await client.result(instance, timeout=20)
    history = await history_of(client, instance)
    assert [t for _, t, _ in history].count("StepAttemptStarted") == 1
    assert "StepSucceeded" not in [t for _, t, _ in history]


async def test_a_paused_run_times_out_too(client: Client) -> None:
    instance = await client.start("deadline", {"wait": True}, instance_id=new_id("paused"))

    async def waiting() -> bool:
        return any(w.event == "go" for w in (await client.status(instance)).waits)

    await until(waiting)
    await client.pause(instance)
    with pytest.raises(WorkflowTimeout):
        await client.result(instance, timeout=20)
    types = [t for _, t, _ in await history_of(client, instance)]
    assert types[-2:] == ["WorkflowPaused", "WorkflowFailed"]


async def test_a_run_that_finishes_first_cancels_its_timeout(client: Client) -> None:
    instance = await client.start("deadline", {"sleep": 0.1}, instance_id=new_id("quick"))
    assert await client.result(instance, timeout=20) == "in time"
    await asyncio.sleep(2)  # past the 1.5 s: the timer fired into nothing, or not at all
    status = await client.status(instance)
    assert (status.status, status.error) == ("completed", None)
    assert (await history_of(client, instance))[-1][1] == "WorkflowCompleted"


async def test_a_timed_out_instance_can_be_restarted(client: Client) -> None:
    instance = await client.start("deadline", {"wait": True}, instance_id=new_id("retry"))
    with pytest.raises(WorkflowTimeout):
        await client.result(instance, timeout=20)
    await client.start(
        "deadline", {"sleep": 0.1}, instance_id=instance, if_exists="restart_if_failed"
    )
    assert await client.result(instance, timeout=20) == "in time"


# ---- terminate -------------------------------------------------------------------------


async def test_terminate_ends_at_once_without_compensations(client: Client) -> None:
    instance = await client.start("terminable", None, instance_id=new_id("term"))

    async def hanging() -> bool:
        types = [t for _, t, _ in await history_of(client, instance)]
        return "ChildStarted" in types and types.count("StepAttemptStarted") == 2

    await until(hanging)
    await client.terminate(instance, reason="supplier is down")
    with pytest.raises(WorkflowTerminated, match="terminated: supplier is down") as err:
        await client.result(instance, timeout=10)
    assert isinstance(err.value, WorkflowCancelled) and err.value.reason == "supplier is down"
    status = await client.status(instance)
    assert (status.status, status.error) == ("terminated", "terminated: supplier is down")
    history = await history_of(client, instance)
    types = [t for _, t, _ in history]
    # The end; after it only commands that came too late (the terminated child's outcome,
    # say) are recorded, as ignored.
    end = types.index("WorkflowTerminated")
    assert set(types[end + 1 :]) <= {"CommandIgnored"}, types
    assert not [a for _, t, a in history if t == "StepAttemptStarted" and "undo" in a["key"]]
    # The child it waited for is terminated too.
    (child,) = [a["child_id"] for _, t, a in history if t == "ChildStarted"]

    async def child_ended() -> bool:
        return (await client.status(child)).status == "terminated"

    await until(child_ended)
    assert [i.instance_id for i in await client.list(status="terminated")].count(instance) == 1


async def test_terminate_of_a_finished_instance_is_refused(client: Client) -> None:
    instance = await client.start("flaky-once", {"n": 1}, instance_id=new_id("done"))
    await client.result(instance, timeout=20)
    with pytest.raises(InstanceFinished, match=f"{instance} is already completed"):
        await client.terminate(instance, reason="too late")
    assert (await client.status(instance)).status == "completed"


def test_the_documented_example_runs() -> None:
    """examples/lifecycle.py, as docs/workflows.md says to run it, prints what its
    comments say."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    assert "examples/lifecycle.py" in (repo / "docs/workflows.md").read_text()
    done = subprocess.run(
        [sys.executable, "-m", "examples.lifecycle"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "fail: running",
        "timeout: WorkflowTimeout",
        "run 2: {'carrier': 'dhl'}",
        "terminate: supplier gone",
    ]
