"""The workflow loop's own bookkeeping of its tasks."""

from __future__ import annotations

import asyncio
from typing import Any

from stepstream.engine.replay.loop import WorkflowLoop


async def _wait(gate: asyncio.Future[Any]) -> Any:
    return await gate


def test_the_loop_knows_every_running_task_and_lets_finished_ones_go() -> None:
    """Thousands of tasks at once (a gather over many steps): every running one is
    known, to be cancelled when the instance is put away, and finished ones are not
    kept."""
    loop = WorkflowLoop("wf/many")
    gates = [loop.create_future() for _ in range(1_000)]
    first = [loop.create_task(_wait(gate)) for gate in gates]
    loop.run_until_quiet()
    assert set(loop.pending_tasks()) == set(first)
    for gate in gates[:990]:
        gate.set_result(None)
    loop.run_until_quiet()
    later = [loop.create_task(_wait(loop.create_future())) for _ in range(200)]
    loop.run_until_quiet()
    running = set(first[990:]) | set(later)
    assert set(loop.pending_tasks()) == running
    assert len(loop._tasks) <= 2 * len(running) + 64  # the 990 finished ones were let go
    for task in running:
        task.cancel()
    loop.run_until_quiet()
    assert loop.pending_tasks() == []
    loop.close()
