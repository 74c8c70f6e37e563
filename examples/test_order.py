"""Testing the order workflow (examples/order.py) with ``stepstream.testing``.

Run with ``python -m pytest examples/test_order.py``. The environment is an embedded
engine in a temporary directory whose clock moves only when the test says so: a day-long
approval timeout takes no wall time, and ``env.crash()`` restarts the engine from its
log as a kill -9 would.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples import order
from stepstream import WorkflowFailed
from stepstream.ops.tools.history_export import records_from_entries, write_export
from stepstream.testing import WorkflowEnvironment, replay

DAY = 86400.0


async def test_an_approved_order_ships_after_its_cool_off() -> None:
    async with WorkflowEnvironment([order], clock="virtual") as env:
        await env.client.start(
            "order", {"card": "4242", "needs_approval": True, "cool_off_s": 3600}, instance_id="o-1"
        )
        await env.settle()  # charged and waiting for the approval
        assert [w.key for w in (await env.client.status("o-1")).waits] == ["approval"]

        await env.client.send_event("o-1", "approval", {"by": "ada"})
        await env.advance(3600)  # the cool-off: an hour of virtual time
        result = await env.client.result("o-1", timeout=5)
    assert result["approval"] == {"by": "ada"}
    assert result["receipt"].startswith("receipt for o-1: ch_")


async def test_an_order_nobody_approves_fails_after_a_day() -> None:
    async with WorkflowEnvironment([order], clock="virtual") as env:
        await env.client.start("order", {"needs_approval": True}, instance_id="o-2")
        await env.advance(DAY)
        with pytest.raises(WorkflowFailed, match="EventTimeout"):
            await env.client.result("o-2", timeout=5)


async def test_a_crash_while_waiting_loses_nothing() -> None:
    async with WorkflowEnvironment([order], clock="virtual") as env:
        await env.client.start("order", {"needs_approval": True}, instance_id="o-3")
        await env.settle()
        await env.crash()  # as kill -9: the engine restarts from its log
        await env.client.send_event("o-3", "approval", {"by": "bo"})
        await env.advance(1)
        result = await env.client.result("o-3", timeout=5)
        history = await env.client.history("o-3")
    assert result["approval"] == {"by": "bo"}
    assert [e.attributes["key"] for e in history if e.type == "StepSucceeded"].count("charge") == 1


async def test_a_recorded_history_still_replays(tmp_path: Path) -> None:
    """Keep exported histories (``stepstream history ID --export FILE``) next to the
    tests: replaying them fails the test if a change breaks instances in flight."""
    async with WorkflowEnvironment([order], clock="virtual") as env:
        await env.client.start("order", {"cool_off_s": 60}, instance_id="o-4")
        await env.advance(60)
        entries = await env.client.history("o-4")
    exported = tmp_path / "o-4.json"
    write_export(exported, "o-4", records_from_entries("o-4", entries))
    assert replay(exported, [order]).result["approval"] == {"by": "auto"}
