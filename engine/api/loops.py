"""``ctx.loop``: a loop whose iterations are scopes, with carried state and pruning.

Iteration ``i`` runs ``body(ctx, state)`` in the scope ``<key>/<i>/`` (and in a task of
its own, named ``<key>/<i>``, so values read there are keyed by the iteration too). It
returns ``Continue(new_state)`` or ``Break(value)``. Each ``Continue`` is recorded
(``LoopAdvanced``, with the state), which makes two things possible:

- replay starts at the last recorded iteration with its state: iterations before it are
  not run again, so replay time does not grow with the number of iterations;
- iterations older than the last ``keep`` are pruned: their entries leave the state and
  their records the instance's stored history, so an endless loop holds bounded state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from stepstream.engine.api.scopes import current_scope
from stepstream.engine.errors import InvalidWorkflowCall

if TYPE_CHECKING:
    from stepstream.engine.api.context import Context

S = TypeVar("S")
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Continue(Generic[S]):
    """Run the next iteration with ``state``."""

    state: S


@dataclass(frozen=True, slots=True)
class Break(Generic[V]):
    """End the loop; ``ctx.loop`` returns ``value``."""

    value: V = None  # type: ignore[assignment]


LoopBody = Callable[["Context", Any], Coroutine[Any, Any, "Continue[Any] | Break[Any]"]]


async def run_loop(ctx: Context, key: str, body: LoopBody, state: Any, keep: int) -> Any:
    rt = ctx._rt
    iteration, state = rt.loop_resume(key, state)
    while True:
        scope = f"{key}/{iteration}/"

        async def one(current: Any = state, scope: str = scope) -> Any:
            current_scope.set(scope)
            return await body(ctx, current)

        loop = asyncio.get_running_loop()
        create = getattr(loop, "create_named_task", None)
        if create is None:
            raise InvalidWorkflowCall("ctx.loop runs only inside a workflow")
        outcome = await create(one(), f"{key}/{iteration}")
        if isinstance(outcome, Break):
            return outcome.value
        if not isinstance(outcome, Continue):
            raise InvalidWorkflowCall(
                f"loop {key!r}: the body returned {type(outcome).__name__}; return "
                "Continue(state) for another iteration or Break(value) to end the loop"
            )
        iteration += 1
        state = rt.loop_advanced(key, iteration, outcome.state, keep)
