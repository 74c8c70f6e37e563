"""A reset survives kill -9: the restarted `stepstream dev` folds the same state from its
data directory, replays the code against the history that still counts (the steps before
the key do not run again), and goes on from there."""

from __future__ import annotations

from typing import Any

import pytest

from stepstream import WorkflowFailed
from stepstream.producers.client import Client
from tests.faults.test_kill9 import Dev, dev, explained, wait_for

pytestmark = pytest.mark.slow
__all__ = ["dev"]  # the fixture, used by name


async def _failed(client: Client, instance: str) -> bool:
    return (await client.status(instance)).status == "failed"


async def _view(client: Client, instance: str) -> tuple[Any, ...]:
    status = (await client.status(instance)).to_json()
    history = [(h.seq, h.type, h.set_aside, h.attributes) for h in await client.history(instance)]
    return status, history


async def test_reset_then_kill9_restores_the_same_state_and_goes_on(dev: Dev) -> None:
    settled, raced = "r-settled", "r-raced"
    async with explained(dev, settled, raced), dev.client() as client:
        for instance in (settled, raced):
            await client.start("repairable", {}, instance_id=instance)
            await client.send_event(instance, "go", {"by": "ada"})
            with pytest.raises(WorkflowFailed):
                await client.result(instance, timeout=20)
        await client.reset(settled, to="charge#2", reason="before the crash")
        await wait_for(lambda: _failed(client, settled), f"{settled} to fail again")
        before = await _view(client, settled)
        # Durable once reset() returns: killed right after, it must still apply.
        await client.reset(raced, to="charge#2")
    await dev.restart_after_kill9()
    async with explained(dev, settled, raced), dev.client() as client:
        assert await _view(client, settled) == before
        await wait_for(lambda: _failed(client, raced), f"{raced} to fail after its reset")
        for instance in (settled, raced):
            types = [h.type for h in await client.history(instance)]
            assert types.count("WorkflowReset") == 1, types
            (dev.ledger / f"open-{instance}").touch()
            await client.retry(instance)
            result = await client.result(instance, timeout=20)
            assert result["ship"] == "shipped"
            # Before the key: run once, ever. From it on: again after the reset.
            assert dev.ran(f"{instance}-charge") == 1
            # charge#2 ran before the reset and once after it; ship also ran for the retry.
            # Killed right after the reset, a step it ran again may have run before the kill
            # and once more after it: at least once per run, at most one more.
            for step, runs in (("charge#2", 2), ("ship", 3)):
                ran = dev.ran(f"{instance}-{step}")
                assert ran == runs if instance == settled else ran in (runs, runs + 1), step
