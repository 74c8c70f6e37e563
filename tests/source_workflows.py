"""Workflows fed by source topics in the tests. ``orders`` and ``payments`` read the
topics named by ``STEPSTREAM_TEST_SOURCE_TOPIC`` and ``STEPSTREAM_TEST_EVENT_TOPIC``
(fresh ones per test), so a worker subprocess that loads this module with
``--workflows`` reads the topics its test produced to."""

from __future__ import annotations

import os
from typing import Any

from stepstream import Context, Source, workflow


@workflow("src-order")
async def src_order(ctx: Context, order: Any) -> dict[str, Any]:
    """Returns its input; with ``{"wait": true}`` waits for the event ``paid`` first."""
    if isinstance(order, dict) and order.get("wait"):
        paid = await ctx.wait_for_event("paid", timeout=120)
        return {"input": order, "paid": paid}
    return {"input": order}


orders = Source(os.environ.get("STEPSTREAM_TEST_SOURCE_TOPIC", "test.src-orders"), start=src_order)
payments = Source(os.environ.get("STEPSTREAM_TEST_EVENT_TOPIC", "test.src-paid"), event="paid")
