"""``ctx.join`` and ``ctx.race``: branches (``async (ctx) -> value``) run side by side,
each in a task and a scope of its own (``<key>/<branch>/``). A join waits for every
branch; a race records its winner, so a replay runs only that branch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from stepstream.engine.api.scopes import current_scope
from stepstream.engine.errors import InvalidWorkflowCall, JoinError, RaceError
from stepstream.engine.wire.codec import error_message
from stepstream.engine.wire.names import step_name_problem

if TYPE_CHECKING:
    from stepstream.engine.api.context import Context

Branch = Callable[["Context"], Coroutine[Any, Any, Any]]


def check_branches(what: str, branches: object) -> None:
    if not isinstance(branches, Mapping):
        raise InvalidWorkflowCall(
            f"ctx.{what} takes a dict of branch name -> async function(ctx), not "
            f"{type(branches).__name__}"
        )
    for name, branch in branches.items():
        problem = step_name_problem(name)
        if problem is not None:
            raise InvalidWorkflowCall(f"ctx.{what}: branch name {problem}")
        if not callable(branch):
            raise InvalidWorkflowCall(
                f"ctx.{what}: branch {name!r} is {type(branch).__name__} {branch!r:.60}, "
                "not an async function taking ctx"
            )


def _tasks(
    ctx: Context, key: str, branches: dict[str, Branch]
) -> tuple[dict[str, str], dict[str, asyncio.Task[Any]]]:
    """Each branch's scope, and its task, made in order: task paths (the keys of
    ``ctx.now`` and friends) are then those of the live run on every replay."""
    scopes = {name: f"{key}/{name}/" for name in branches}
    tasks = {b: asyncio.ensure_future(_in_scope(scopes[b], fn, ctx)) for b, fn in branches.items()}
    return scopes, tasks


async def _in_scope(scope: str, branch: Branch, ctx: Context) -> Any:
    current_scope.set(scope)  # this task's own context: the caller's is untouched
    return await branch(ctx)


def _failures(errors: dict[str, BaseException]) -> str:
    return ", ".join(f"{b}: {type(e).__name__}: {error_message(e)}" for b, e in errors.items())


async def join(ctx: Context, key: str, branches: dict[str, Branch]) -> dict[str, Any]:
    _, tasks = _tasks(ctx, key, branches)
    await asyncio.wait(tasks.values())
    results = {b: t.result() for b, t in tasks.items() if not t.cancelled() and not t.exception()}
    errors: dict[str, BaseException] = {}
    for b, t in tasks.items():
        if t.cancelled():
            errors[b] = asyncio.CancelledError(f"branch {b!r} was cancelled")
        elif t.exception() is not None:
            errors[b] = t.exception()  # type: ignore[assignment]
    if errors:
        raise JoinError(
            f"{len(errors)} of {len(tasks)} branches of {key!r} failed ({_failures(errors)})",
            errors=errors,
            results=results,
        )
    return results


async def race(ctx: Context, key: str, branches: dict[str, Branch]) -> tuple[str, Any]:
    rt = ctx._rt
    decided = rt.race_decided(key)
    if decided is not None and decided[0] not in branches:
        raise InvalidWorkflowCall(
            f"race {key!r} was won by branch {decided[0]!r}, which the code no longer "
            f"has (it has {', '.join(branches)})"
        )
    scopes, tasks = _tasks(ctx, key, branches)
    if decided is not None:  # on replay the losers never start
        for b, task in tasks.items():
            if b != decided[0]:
                rt.race_lost(task.get_name())
                task.cancel()
        return decided[0], await tasks[decided[0]]
    errors: dict[str, BaseException] = {}
    pending = set(tasks.values())
    while pending:
        _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for b, task in tasks.items():  # declaration order breaks a tie
            if not task.done() or b in errors:
                continue
            if task.cancelled() or task.exception() is not None:
                errors[b] = task.exception() or asyncio.CancelledError(b)
                continue
            rt.decide_race(key, b, [scopes[o] for o in tasks if o != b])
            for other in tasks.values():
                other.cancel()
            await asyncio.wait([t for t in tasks.values() if t is not task])
            return b, task.result()
    raise RaceError(f"every branch of {key!r} failed ({_failures(errors)})", errors=errors)
