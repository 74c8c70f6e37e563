"""Today's code for the replay goldens (``tests/golden/replay/*.json``).

Each history there was recorded by an earlier version of one of these workflows (see
``test_replay_goldens.py``): the ``ok-*`` ones by code that still matches, the
``diverged-*`` ones by code that was since changed in a way that breaks its instances.
"""

from __future__ import annotations

from typing import Any

from stepstream import Break, Context, Continue, RetryPolicy, workflow


def charge(amount: int) -> dict[str, Any]:
    return {"charged": amount}


def ship(order_id: str) -> str:
    return f"shipped {order_id}"


def note(text: str) -> str:
    return text


_attempts: dict[str, int] = {}


def flaky(key: str) -> str:
    """Fails the first attempt of each key (in the process that records the golden)."""
    _attempts[key] = _attempts.get(key, 0) + 1
    if _attempts[key] == 1:
        raise ConnectionError("the first attempt fails")
    return "done"


@workflow("order")
async def order(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    charged = await ctx.step("charge", charge, order["amount"])
    approval = await ctx.wait_for_event("approval", timeout=3600)
    await ctx.sleep("cool-off", 60)
    shipped = await ctx.step("ship", ship, order["id"])
    return {"charged": charged, "approval": approval, "shipped": shipped}


@workflow("values")
async def values(ctx: Context, _: Any) -> dict[str, Any]:
    at = ctx.now().isoformat()
    token = str(ctx.uuid())
    roll = ctx.random()
    echoed = await ctx.step("echo", note, f"{token}/{roll}")
    return {"at": at, "echoed": echoed}


@workflow("retrying")
async def retrying(ctx: Context, key: str) -> str:
    return await ctx.step(
        "flaky", flaky, key, retry=RetryPolicy(max_attempts=3, initial_interval=2)
    )


@workflow("extended")
async def extended(ctx: Context, _: Any) -> str:
    await ctx.step("a", note, "a")
    await ctx.wait_for_event("go")
    # Added after the goldens were recorded: instances still waiting go on through it;
    # those that had completed never made this call.
    await ctx.step("b", note, "b")
    return "done"


@workflow("renamed")
async def renamed(ctx: Context, amount: int) -> Any:
    return await ctx.step("charge", charge, amount)  # was "charge-card"


@workflow("step-to-sleep")
async def step_to_sleep(ctx: Context, _: Any) -> str:
    await ctx.sleep("notify", 60)  # was a step named "notify"
    return "done"


@workflow("inserted-wait")
async def inserted_wait(ctx: Context, _: Any) -> str:
    await ctx.step("a", note, "a")
    await ctx.wait_for_event("approval")  # inserted before a recorded step
    await ctx.step("b", note, "b")
    return "done"


@workflow("removed-step")
async def removed_step(ctx: Context, _: Any) -> str:
    await ctx.step("a", note, "a")
    # a step "audit" was here
    await ctx.step("b", note, "b")
    return "done"


@workflow("loop")
async def loop(ctx: Context, rounds: int) -> int:
    async def body(c: Context, n: int) -> Continue[int] | Break[int]:
        await c.step("tick", note, str(n))
        await c.sleep("pause", 1)
        return Break(n) if n + 1 >= rounds else Continue(n + 1)

    # Only the last 2 iterations' records are kept: the history has a gap.
    return await ctx.loop("poll", body, state=0, keep=2)
