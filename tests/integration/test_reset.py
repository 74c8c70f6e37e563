"""Reset, retry and fork through the public client, on each backend: what replays, what
runs again, what the history keeps, and what is refused."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from stepstream import InstanceExists, WorkflowFailed
from stepstream.errors import InstanceNotFailed, UnknownReplayKey
from stepstream.producers.client import Client
from tests.workflows import ledger_count


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def failed_order(client: Client) -> str:
    """An instance of ``repairable`` that failed at its ship step."""
    instance = await client.start("repairable", {}, instance_id=new_id("order"))
    await client.send_event(instance, "go", {"by": "ada"})
    with pytest.raises(WorkflowFailed, match="warehouse"):
        await client.result(instance, timeout=20)
    return instance


async def test_reset_replays_the_prefix_and_sets_the_rest_aside(
    client: Client, ledger: Path
) -> None:
    instance = await failed_order(client)
    (ledger / f"open-{instance}").touch()
    await client.reset(instance, to="charge#2", reason="warehouse open again")
    result = await client.result(instance, timeout=20)
    history = await client.history(instance)
    print(f"history of {instance}:", *[(h.seq, h.type, h.set_aside) for h in history])
    # The event taken after the key reaches the code that runs on: nothing sent is lost.
    assert result == {
        "charges": ["charged charge", "charged charge#2"],
        "go": {"by": "ada"},
        "ship": "shipped",
    }
    # Before the key: replayed, not run again. From the key on: run again.
    assert ledger_count(ledger, f"{instance}-charge") == 1
    assert ledger_count(ledger, f"{instance}-charge#2") == 2
    assert ledger_count(ledger, f"{instance}-ship") == 2
    reset = next(h for h in history if h.type == "WorkflowReset")
    assert reset.attributes["to"] == "charge#2"
    assert reset.attributes["reason"] == "warehouse open again"
    aside = [h for h in history if h.set_aside]
    # Kept, marked: everything from the key's first record up to the reset.
    assert [h.seq for h in aside] == list(range(reset.attributes["from_seq"], reset.seq))
    assert {"WorkflowFailed", "StepFailed"} <= {h.type for h in aside}
    assert not any(h.set_aside for h in history if h.seq > reset.seq)
    assert (await client.status(instance)).status == "completed"


async def test_a_sleep_open_before_the_key_fires_again_after_the_reset(client: Client) -> None:
    """The sleep began before the key and fired after it: its fire is set aside, and the
    timer armed again by the reset fires anew (it was once taken for the set-aside
    fire, seen again, and the instance slept for ever)."""
    instance = await client.start("sleep-beside-a-step", 0.5, instance_id=new_id("nap"))
    assert await client.result(instance, timeout=20) == [None, 3]
    await client.reset(instance, to="b", reason="again")
    assert await client.result(instance, timeout=20) == [None, 3]
    history = await client.history(instance)
    elapsed = [h for h in history if h.type == "SleepElapsed"]
    assert [h.set_aside for h in elapsed] == [True, False], history


async def test_retry_runs_the_failed_step_again_with_fresh_attempts(
    client: Client, ledger: Path
) -> None:
    instance = await failed_order(client)
    (ledger / f"open-{instance}").touch()
    await client.retry(instance, reason="fixed")
    result = await client.result(instance, timeout=20)
    assert result["ship"] == "shipped"
    assert ledger_count(ledger, f"{instance}-charge#2") == 1  # before the failed step
    assert ledger_count(ledger, f"{instance}-ship") == 2
    history = await client.history(instance)
    reset = next(h for h in history if h.type == "WorkflowReset")
    assert reset.attributes["retry"] is True and reset.attributes["to"] == "ship"
    # The step's attempts go on counting above the one set aside.
    attempts = [h.attributes["attempt"] for h in history if h.type == "StepAttemptStarted"]
    assert attempts[-1] == 2
    with pytest.raises(InstanceNotFailed, match=f"instance {instance} is completed, not failed"):
        await client.retry(instance)


async def test_a_run_started_again_numbers_its_attempts_from_one(
    client: Client, ledger: Path
) -> None:
    """The attempt numbers a retry set aside count within their run only: a restart
    begins a run whose steps start again at attempt 1."""
    instance = await failed_order(client)
    await client.retry(instance)  # ship fails again, as attempt 2
    with pytest.raises(WorkflowFailed, match="warehouse"):
        await client.result(instance, timeout=20)
    (ledger / f"open-{instance}").touch()
    await client.start("repairable", {}, instance_id=instance, if_exists="restart_if_failed")
    await client.send_event(instance, "go", {"by": "ada"})
    assert (await client.result(instance, timeout=20))["ship"] == "shipped"
    history = await client.history(instance)
    restarted = max(h.seq for h in history if h.type == "WorkflowRestarted")
    started = [
        (h.attributes["key"], h.attributes["attempt"])
        for h in history
        if h.type == "StepAttemptStarted" and h.seq > restarted
    ]
    assert ("ship", 1) in started and all(attempt == 1 for _, attempt in started), started


async def test_reset_to_a_key_the_history_lacks_is_refused(client: Client) -> None:
    instance = await failed_order(client)
    with pytest.raises(UnknownReplayKey) as refused:
        await client.reset(instance, to="charge#3")
    message = str(refused.value)
    assert "'charge#3'" in message and "charge, charge#2, go, ship" in message
    with pytest.raises(UnknownReplayKey, match="charge, charge#2"):
        await client.fork(instance, to="refund")
    # Refused, it changed nothing.
    assert (await client.status(instance)).status == "failed"


async def test_fork_starts_a_new_instance_from_the_prefix(client: Client, ledger: Path) -> None:
    source = await failed_order(client)
    fork_id = f"{source}-b"
    (ledger / f"open-{fork_id}").touch()
    forked = await client.fork(source, to="ship", instance_id=fork_id)
    assert forked == fork_id
    result = await client.result(fork_id, timeout=20)
    assert result["ship"] == "shipped"
    status = await client.status(fork_id)
    assert status.origin == f"forked from {source} at ship"
    # The fork's steps before the key replay the source's results: none ran for it.
    assert ledger_count(ledger, f"{fork_id}-charge") == 0
    assert ledger_count(ledger, f"{fork_id}-ship") == 1
    history = await client.history(fork_id)
    types = [h.type for h in history]
    assert types[0] == "WorkflowStarted" and "WorkflowForked" in types
    assert "StepSucceeded" in types[: types.index("WorkflowForked")]
    # The source is as it was; a fork of it without an id gets one of its own.
    assert (await client.status(source)).status == "failed"
    other = await client.fork(source, to="charge#2")
    assert other != fork_id and other.startswith(source)
    assert (await client.status(other)).origin == f"forked from {source} at charge#2"


async def test_of_two_forks_racing_for_one_id_the_loser_is_told(client: Client) -> None:
    source = await failed_order(client)
    new = f"{source}-x"
    outcomes = await asyncio.gather(
        client.fork(source, to="ship", instance_id=new),
        client.fork(source, to="charge#2", instance_id=new),
        return_exceptions=True,
    )
    won = [o for o in outcomes if o == new]
    lost = [o for o in outcomes if isinstance(o, InstanceExists)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert f"instance {new} already exists" in str(lost[0])
    origin = (await client.status(new)).origin
    assert origin in (f"forked from {source} at ship", f"forked from {source} at charge#2")
    assert origin in str(lost[0])  # the loser is told which fork holds the id
