"""Search attributes: an order says whose it is, how much and how far it got, so a
listing finds it by them (``stepstream list --where customer=42``).

    stepstream run examples.attributes:purchase --input '{"customer": "42", "amount": 25.0}'
"""

from __future__ import annotations

from typing import Any

from stepstream import Context, workflow


def charge_card(amount: float) -> str:
    return f"ch-{amount:.2f}"


@workflow("purchase")
async def purchase(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    ctx.set_attributes(
        {"customer": order["customer"], "amount": order["amount"], "stage": "paying"}
    )
    charge = await ctx.step("charge", charge_card, order["amount"])
    # Merged into what is there: "stage" changes, "customer" and "amount" stay.
    ctx.set_attributes({"stage": "paid", "vip": order["amount"] >= 100})
    return {"charge": charge}
