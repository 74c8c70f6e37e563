"""A run's timeout and terminate across a kill -9 of `stepstream dev` and a restart on
the same data directory: the timeout's timer is durable (it fires after the restart,
or at once if it fell due while nothing ran), and a terminate applies exactly once."""

from __future__ import annotations

import asyncio
import time

import pytest

from stepstream import WorkflowFailed, WorkflowTerminated, WorkflowTimeout
from tests.faults.test_kill9 import Dev, check_history, dev, explained, wait_for  # noqa: F401

pytestmark = pytest.mark.slow

# tests.lifecycle_workflows' "slow-deadline": a wait that never ends, a 6 s run timeout.
LIMIT_S = 6.0


@pytest.mark.parametrize("down_for", [0.0, LIMIT_S + 1], ids=["back-before", "back-after"])
async def test_the_timeout_survives_a_kill9(dev: Dev, down_for: float) -> None:  # noqa: F811
    name = f"deadline-{int(down_for)}"
    async with dev.client() as client:
        began = time.monotonic()
        await client.start("slow-deadline", None, instance_id=name)

        async def waiting() -> bool:
            return any(w.event == "never" for w in (await client.status(name)).waits)

        await wait_for(waiting, "the instance to wait")
    await dev.restart_after_kill9(down_for=down_for)

    async with explained(dev, name), dev.client() as client:
        with pytest.raises(WorkflowTimeout, match="within its timeout of 6 s"):
            await client.result(name, timeout=30)
        assert time.monotonic() - began >= LIMIT_S
        history = await client.history(name)
        check_history(name, history)
        types = [h.type for h in history]
        assert types.count("WorkflowTimeoutSet") == 1
        assert types.count("WorkflowFailed") == 1 and types[-1] == "WorkflowFailed"
        failed = history[-1].attributes
        assert failed["error_type"] == "WorkflowTimeout"
        status = await client.status(name)
        assert (status.status, status.waits) == ("failed", [])


async def test_a_terminate_applies_once_across_a_kill9(dev: Dev) -> None:  # noqa: F811
    names = [f"term-{n}" for n in range(5)]
    async with dev.client() as client:
        for name in names:
            await client.start("flaky-once", {"wait": True}, instance_id=name)

        async def all_running() -> bool:
            statuses = await asyncio.gather(*(client.status(n) for n in names))
            return all(s.status == "running" for s in statuses)

        await wait_for(all_running, "every instance to run")
        # Acknowledged, then killed at once: some may have been applied, some not yet.
        await asyncio.gather(*(client.terminate(n, reason="killed after") for n in names))
    await dev.restart_after_kill9()

    async with explained(dev, *names), dev.client() as client:
        for name in names:
            with pytest.raises(WorkflowTerminated, match="killed after"):
                await client.result(name, timeout=20)
            history = await client.history(name)
            check_history(name, history)
            types = [h.type for h in history]
            assert types.count("WorkflowTerminated") == 1 and types[-1] == "WorkflowTerminated"
            assert "CommandIgnored" not in types  # the command was not applied twice
            assert (await client.status(name)).status == "terminated"


async def test_a_restarted_run_replays_after_a_kill9(dev: Dev) -> None:  # noqa: F811
    """The second run's state (the first run's entries set aside) is what is stored: a
    kill -9 mid second run replays it alone, not the first run's records."""
    name = "restarted"
    async with dev.client() as client:
        await client.start("flaky-once", {"fail": True}, instance_id=name)
        with pytest.raises(WorkflowFailed):
            await client.result(name, timeout=20)
        await client.start(
            "flaky-once", {"wait": True, "n": 4}, instance_id=name, if_exists="restart_if_failed"
        )

        async def waiting() -> bool:
            return any(w.event == "go" for w in (await client.status(name)).waits)

        await wait_for(waiting, "the second run to wait")
    await dev.restart_after_kill9()

    async with explained(dev, name), dev.client() as client:
        await client.send_event(name, "go", None)
        assert await client.result(name, timeout=20) == {"ok": 4}
        status = await client.status(name)
        assert (status.status, status.run) == ("completed", 2)
        types = [h.type for h in await client.history(name)]
        assert types.count("WorkflowRestarted") == 1 and types.count("WorkflowStarted") == 2
        assert types.count("WaitStarted") == 1 and types[-1] == "WorkflowCompleted"
