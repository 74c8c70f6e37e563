"""Where a waiting instance stands in its queue, for status reads.

The queue's instance (``~queue/<name>[/<key>]``) keeps its waiters in its loop state,
recorded with each decision (``engine.api.queue_service``). A status read of an instance
that waits for a slot reads that state, once per queue it waits on, and numbers the
waiters as the queue will admit them (priority, then arrival): nothing is written when
the queue moves, and an instance that waits for no queue costs no extra read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from stepstream.engine.api.queue_service import LOOP
from stepstream.engine.errors import StepstreamError
from stepstream.engine.reads.views import HistoryEntry, InstanceStatus, Wait


class _Reads(Protocol):
    async def history(self, instance_id: str) -> list[HistoryEntry]: ...


async def with_queue_positions(reads: _Reads, status: InstanceStatus) -> InstanceStatus:
    """``status`` with ``position`` (1: admitted next) and ``waiting`` (how many wait in
    that queue) set on each wait for a queue slot whose request the queue has taken; a
    request on its way to the queue, or a queue that cannot be read now, leaves them
    unset."""
    if not any(_unplaced(w) for w in status.waits):
        return status
    queues: dict[str, list[list[Any]] | None] = {}
    waits: list[Wait] = []
    for wait in status.waits:
        if wait.queue and _unplaced(wait):
            if wait.queue not in queues:
                queues[wait.queue] = await _waiting(reads, wait.queue)
            wait = _placed(wait, queues[wait.queue], status)
        waits.append(wait)
    return dataclasses.replace(status, waits=waits)


def _unplaced(wait: Wait) -> bool:
    # Admitted (a paused instance's, its code not yet on): it has no place in the queue.
    return bool(wait.queue) and wait.position is None and wait.state == "waiting"


async def _waiting(reads: _Reads, queue: str) -> list[list[Any]] | None:
    """The queue's waiters in admission order, from its last recorded decision."""
    try:
        history = await reads.history(queue)
    except StepstreamError:
        return None  # its owner is down or it is not there yet: no position, no error
    state = next(
        (
            e.attributes.get("state")
            for e in reversed(history)
            if e.type == "LoopAdvanced" and e.attributes.get("key") == LOOP
        ),
        None,
    )
    if not isinstance(state, dict) or not isinstance(state.get("waiting"), list):
        return None
    return sorted(state["waiting"], key=lambda w: (w[0], w[1]))


def _placed(wait: Wait, waiting: list[list[Any]] | None, status: InstanceStatus) -> Wait:
    if waiting is None:
        return wait
    # What the queue knows the request by (``engine.api.queues.acquire``).
    token = wait.key if status.run == 1 else f"run{status.run}/{wait.key}"
    for position, waiter in enumerate(waiting, start=1):
        if waiter[2] == status.instance_id and waiter[3] == token:
            return dataclasses.replace(wait, position=position, waiting=len(waiting))
    return wait
