"""Queues: limits that hold across every worker of the group.

``payments`` lets at most 10 charges run at once and admits at most 100 a minute, however
many workers run ``charge``; an instance waits with status ``pending`` until it is
admitted. ``partner-api`` limits the calls to a partner's API to 2 at a time for each
tenant (``per_key=True``: the instance's ``queue_key`` is its tenant); each call waits
for a slot of its tenant. ``hold`` shows a wait: ``front-desk`` has one slot, which an
instance keeps until it gets the event ``release``. Serve it with
``stepstream dev --workflows examples.queues``; docs/queues.md runs it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from stepstream import Context, Queue, workflow

payments = Queue("payments", concurrency=10, rate=(100, 60.0))
partner_api = Queue("partner-api", concurrency=2, per_key=True)
front_desk = Queue("front-desk", concurrency=1)


async def charge_card(amount: float) -> str:
    await asyncio.sleep(0.1)  # the payment provider
    return f"receipt-{amount:.2f}"


async def notify_partner(receipt: str) -> str:
    await asyncio.sleep(0.05)  # the partner's API
    return f"notified {receipt}"


@workflow("charge", queue=payments)
async def charge(ctx: Context, order: dict[str, Any]) -> dict[str, str]:
    receipt = await ctx.step("charge-card", charge_card, order["amount"])
    notice = await ctx.step("notify", notify_partner, receipt, queue=partner_api)
    return {"receipt": receipt, "notice": notice}


@workflow("hold", queue=front_desk)
async def hold(ctx: Context, _: Any) -> str:
    """Holds the one slot of ``front-desk`` until it gets the event ``release``."""
    await ctx.wait_for_event("release")
    return "released"
