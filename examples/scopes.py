"""Repeated names and ``ctx.scope``: a checkout that charges every item with one step
name, then ships in a scope of its own.

The nth use of a name is its own replay key (``charge``, ``charge#2``, ...), so a step
can sit in a plain ``for`` loop. Inside ``ctx.scope("shipping")`` names are prefixed
(``shipping/charge``), so a block or a helper can reuse names freely.
"""

from __future__ import annotations

from stepstream import Context, workflow

PRICES = {"book": 12.5, "pen": 1.5, "mug": 8.0}


def charge(item: str) -> float:
    return PRICES.get(item, 5.0)


def shipping_fee(n_items: int) -> float:
    return 4.0 + 0.5 * n_items


@workflow("scopes")
async def checkout(ctx: Context, items: list[str]) -> dict[str, object]:
    charged = [await ctx.step("charge", charge, item) for item in items]  # charge, charge#2...
    async with ctx.scope("shipping"):
        fee = await ctx.step("charge", shipping_fee, len(items))  # shipping/charge
    return {"items": sum(charged), "shipping": fee}
