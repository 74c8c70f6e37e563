"""Publishing to Kafka from a workflow (the outbox): an order is priced, then announced
on ``shop.orders.confirmed`` (keyed by the order id) and each of its items on
``shop.shipments``. Each record goes out once the step before it is durable, is retried
until the broker acknowledged it, and carries the header ``stepstream-id``, the same on
every copy, so a consumer that drops ids it has seen handles each one once.

    STEPSTREAM_OUTBOX_BOOTSTRAP=localhost:9092 stepstream run examples.outbox:confirm \\
        --input '{"order": "o-17", "items": ["pen", "book"]}'
"""

from __future__ import annotations

from typing import Any

from stepstream import Context, workflow

PRICES = {"pen": 2, "book": 23}


def price(items: list[str]) -> int:
    return sum(PRICES.get(item, 10) for item in items)


@workflow("confirm-order")
async def confirm(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    total = await ctx.step("price", price, order["items"])
    confirmed = await ctx.publish(
        "shop.orders.confirmed",
        {"order": order["order"], "total": total},  # JSON (the payload codec)
        key=order["order"],
        headers={"origin": "stepstream"},
    )
    for item in order["items"]:  # one name in a loop: its own replay key (and id) each time
        await ctx.publish("shop.shipments", {"order": order["order"], "item": item})
    return {"total": total, "id": confirmed.id, "offset": confirmed.offset}
