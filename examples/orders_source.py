"""Kafka topics as event sources: each record of ``shop.orders`` (JSON, keyed by the
order id) starts a ``fulfilment`` instance with that id; each record of
``shop.payments`` (JSON, the order id in the field ``order.id``) is sent to that
order's instance as the event ``paid``.

    stepstream worker --workflows examples.orders_source --bootstrap localhost:9092
"""

from __future__ import annotations

from typing import Any

from stepstream import Context, Source, workflow


def reserve(items: list[str]) -> list[str]:
    return sorted(items)


@workflow("fulfilment")
async def fulfilment(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    reserved = await ctx.step("reserve", reserve, order["items"])
    payment = await ctx.wait_for_event("paid", timeout=3600)
    return {"order": ctx.instance_id, "items": reserved, "paid": payment["amount"]}


orders = Source("shop.orders", start=fulfilment)  # the record key is the instance id
payments = Source("shop.payments", event="paid", instance_id="field:order.id")
