"""The workflow of a queue's own instance (``~queue/<name>[/<key>]``): it takes
``queue.acquire`` and ``queue.release`` messages in arrival order and decides who is
admitted, by priority (lower first) then arrival, within the queue's concurrency and
rate. Every decision is recorded in its history (a loop iteration per batch of
messages, pruned to the last few), so the limits hold across workers, crashes and
changes of owner. ``engine.api.queues`` is the asking side.

State carried from one iteration to the next (a JSON object):

- ``limits``: the newest limits a request carried;
- ``running``: token -> [instance, key, admitted at ms, what];
- ``waiting``: [priority, arrival number, instance, key, arrived at ms, what], sorted;
- ``admitted``: admission times still inside the rate window;
- ``n``: arrivals so far; ``now``: the iteration's time; ``wake``: when the rate window
  frees a slot for the first waiter (ms), or None.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from stepstream.engine.api.loops import Continue
from stepstream.engine.api.queues import (
    QUEUE_ACQUIRE,
    QUEUE_ADMITTED,
    QUEUE_RELEASE,
    QUEUE_WORKFLOW,
)
from stepstream.engine.api.workflow import WorkflowDefinition
from stepstream.engine.wire.names import event_name_problem, name_problem

if TYPE_CHECKING:
    from stepstream.engine.api.context import Context

# Messages taken per iteration at most: one LoopAdvanced record covers them all.
BATCH = 500
# Iterations whose records are kept (the rest are pruned from state and history).
KEEP = 2
# The loop's replay key: its LoopAdvanced records carry the state above.
LOOP = "serve"


def _token(instance: str, key: str) -> str:
    return f"{len(instance)}:{instance}/{key}"


def initial_state(limits: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "limits": limits or {"concurrency": None, "rate": None},
        "running": {},
        "waiting": [],
        "admitted": [],
        "n": 0,
        "now": 0,
        "wake": None,
    }


def take(state: dict[str, Any], name: str, payload: dict[str, Any], now: int) -> None:
    """Fold one request into ``state``; a repeat or a release of an unknown token
    changes nothing."""
    instance, key = str(payload.get("instance", "")), str(payload.get("key", ""))
    token = _token(instance, key)
    running: dict[str, Any] = state["running"]
    waiting: list[list[Any]] = state["waiting"]
    if name == QUEUE_ACQUIRE:
        if token in running or any(_token(w[2], w[3]) == token for w in waiting):
            return
        if name_problem(instance) or event_name_problem(f"{QUEUE_ADMITTED}{key}"):
            return  # no answer could reach it (its sender refuses such a request now)
        if isinstance(payload.get("limits"), dict):
            state["limits"] = payload["limits"]
        state["n"] += 1
        priority = int(payload.get("priority", 0))
        waiting.append([priority, state["n"], instance, key, now, str(payload.get("what", ""))])
    elif name == QUEUE_RELEASE:
        if running.pop(token, None) is None:
            state["waiting"] = [w for w in waiting if _token(w[2], w[3]) != token]


def admit(state: dict[str, Any], now: int) -> list[tuple[str, str, int]]:
    """Admit waiters while the limits allow: (instance, key, waited ms) for each."""
    limits = state["limits"]
    concurrency = limits.get("concurrency")
    rate = limits.get("rate")
    window_ms = math.ceil(float(rate[1]) * 1000) if rate else 0
    admitted: list[int] = [t for t in state["admitted"] if rate and t > now - window_ms]
    waiting: list[list[Any]] = sorted(state["waiting"], key=lambda w: (w[0], w[1]))
    running: dict[str, Any] = state["running"]
    out: list[tuple[str, str, int]] = []
    wake = None
    while waiting:
        if concurrency is not None and len(running) >= int(concurrency):
            break
        if rate and len(admitted) >= int(rate[0]):
            wake = admitted[-int(rate[0])] + window_ms  # it leaves the window then
            break
        _, _, instance, key, arrived, what = waiting.pop(0)
        running[_token(instance, key)] = [instance, key, now, what]
        if rate:
            admitted.append(now)
        out.append((instance, key, max(0, now - int(arrived))))
    state.update(waiting=waiting, admitted=admitted, now=now, wake=wake)
    return out


async def _iteration(ctx: Context, state: dict[str, Any]) -> Continue[dict[str, Any]]:
    timeout = None
    if state["waiting"] and state["wake"] is not None:
        timeout = max(0, int(state["wake"]) - int(state["now"])) / 1000
    messages = await ctx.messages.next_batch(
        [QUEUE_ACQUIRE, QUEUE_RELEASE], max=BATCH, timeout=timeout
    )
    now = round(ctx.now().timestamp() * 1000)
    for message in messages:
        if isinstance(message.payload, dict):
            take(state, message.name, message.payload, round(message.sent_at.timestamp() * 1000))
    admitted = admit(state, now)
    for instance, key, waited in admitted:
        await ctx.messages.send(
            instance,
            f"{QUEUE_ADMITTED}{key}",
            {"queue": ctx.instance_id, "admitted_ms": now, "waited_ms": waited},
        )
    return Continue(state)


async def serve_queue(ctx: Context, input: Any) -> Any:
    """The queue's instance: admits for ever (it never finishes)."""
    limits = input.get("limits") if isinstance(input, dict) else None
    return await ctx.loop(LOOP, _iteration, state=initial_state(limits), keep=KEEP)


QUEUE_DEFINITION = WorkflowDefinition(QUEUE_WORKFLOW, "1", serve_queue)
