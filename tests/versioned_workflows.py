"""Several versions of one workflow name, side by side, for the version tests.

``pricing`` v1 and v2 quote a price (a step), then wait for a "go" event, and differ in
the rate and the result, so a test can tell which code an instance ran and keep one
waiting across a restart. ``rounding`` declares "10" before "9" (numbers: "10" is the
latest); ``tax`` declares "beta" before "alpha" (not numbers: the last declared is).
"""

from __future__ import annotations

from typing import Any

from stepstream.engine.api.context import Context
from stepstream.engine.api.workflow import workflow


def quote(amount: int, rate: int) -> int:
    return amount * rate


@workflow("pricing", version="1")
async def pricing_v1(ctx: Context, amount: int) -> dict[str, Any]:
    price = await ctx.step("quote", quote, amount, 1)
    await ctx.wait_for_event("go")
    return {"version": "1", "price": price}


@workflow("pricing", version="2")
async def pricing_v2(ctx: Context, amount: int) -> dict[str, Any]:
    price = await ctx.step("quote", quote, amount, 2)
    go = await ctx.wait_for_event("go")
    return {"version": "2", "price": price, "go": go}


@workflow("rounding", version="10")
async def rounding_v10(ctx: Context, value: float) -> str:
    return f"10:{round(value)}"


@workflow("rounding", version="9")
async def rounding_v9(ctx: Context, value: float) -> str:
    return f"9:{int(value)}"


@workflow("tax", version="beta")
async def tax_beta(ctx: Context, amount: int) -> str:
    return "beta"


@workflow("tax", version="alpha")
async def tax_alpha(ctx: Context, amount: int) -> str:
    return "alpha"
