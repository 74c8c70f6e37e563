"""``ctx.join``: branches that run concurrently, each in its own scope, all settled.

A quote needs a shipping rate, a tax rate and a stock check. The branches run at the
same time, and each may use the same step names (``join/shipping/rate`` and
``join/tax/rate``). If a branch raises, the others still finish, then ``JoinError``
carries the failed branches' errors and the others' values: ship to ``"AQ"`` to see it.
"""

from __future__ import annotations

import asyncio

from stepstream import Context, JoinError, NonRetryableError, workflow


async def shipping_rate(country: str) -> float:
    await asyncio.sleep(0.05)  # a slow carrier API
    if country == "AQ":
        raise NonRetryableError(f"no carrier ships to {country}")
    return 4.5


def tax_rate(country: str) -> float:
    return {"DE": 0.19, "FR": 0.20}.get(country, 0.0)


def in_stock(sku: str) -> int:
    return 7


def reserve(sku: str, count: int) -> str:
    return f"{sku} x{count} reserved"


async def stock(ctx: Context, sku: str) -> str:
    if await ctx.step("count", in_stock, sku) < 1:
        return "sold out"
    return await ctx.step("reserve", reserve, sku, 1)  # a branch may run several steps


@workflow("join")
async def quote(ctx: Context, order: dict[str, str]) -> dict[str, object]:
    country = order["country"]
    try:
        return await ctx.join(
            {
                "shipping": lambda c: c.step("rate", shipping_rate, country),
                "tax": lambda c: c.step("rate", tax_rate, country),
                "stock": lambda c: stock(c, order["sku"]),
            }
        )
    except JoinError as exc:
        return {"failed": {b: str(e) for b, e in exc.errors.items()}, "settled": exc.results}
