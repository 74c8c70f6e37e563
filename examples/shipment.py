"""A shipment that fails until its warehouse opens: something to reset, retry and fork
(docs/operations-on-instances.md).

The warehouse is open when a file ``warehouse-open`` exists in the directory the engine
runs in, so the fix is ``touch warehouse-open``, made while the instance waits failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stepstream import Context, NonRetryableError, workflow


def charge(order: dict[str, Any]) -> str:
    return f"charged {order['amount']}"


def label(order: dict[str, Any]) -> str:
    return f"label for {order['to']}"


def ship(label_text: str) -> str:
    if not Path("warehouse-open").exists():
        raise NonRetryableError("the warehouse is closed; open it (touch warehouse-open)")
    return f"shipped with {label_text}"


@workflow("shipment")
async def shipment(ctx: Context, order: dict[str, Any]) -> dict[str, str]:
    charged = await ctx.step("charge", charge, order)
    printed = await ctx.step("label", label, order)
    shipped = await ctx.step("ship", ship, printed)
    return {"charge": charged, "label": printed, "ship": shipped}
