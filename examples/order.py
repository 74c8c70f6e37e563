"""An order workflow: charge a card (with retries), wait for approval, ship."""

from __future__ import annotations

import asyncio
import random

from stepstream import Context, NonRetryableError, RetryPolicy, workflow


def reserve_stock(items: list[str]) -> dict[str, int]:
    return {item: 1 for item in items}


async def charge_card(card: str, amount: float) -> dict[str, object]:
    if card == "declined":
        raise NonRetryableError("card declined by the issuer")
    await asyncio.sleep(0.01)
    return {"charge_id": f"ch_{random.randrange(10**6):06d}", "amount": amount}


def send_receipt(order_id: str, charge: dict[str, object]) -> str:
    return f"receipt for {order_id}: {charge['charge_id']}"


@workflow("order", version="1")
async def order(ctx: Context, order: dict[str, object]) -> dict[str, object]:
    items = [str(i) for i in order.get("items", ["book"])]  # type: ignore[union-attr]
    stock, charge = await asyncio.gather(
        ctx.step("reserve-stock", reserve_stock, items),
        ctx.step(
            "charge",
            charge_card,
            str(order.get("card", "4242")),
            float(order.get("amount", 10.0)),  # type: ignore[arg-type]
            retry=RetryPolicy(max_attempts=5, initial_interval=0.2, backoff=2.0, max_interval=30),
            timeout=30,
        ),
    )
    if order.get("needs_approval"):
        approval = await ctx.wait_for_event("approval", timeout=86400)
    else:
        approval = {"by": "auto"}
    await ctx.sleep("cool-off", float(order.get("cool_off_s", 0.2)))  # type: ignore[arg-type]
    receipt = await ctx.step("send-receipt", send_receipt, ctx.instance_id, charge)
    return {"stock": stock, "charge": charge, "approval": approval, "receipt": receipt}
