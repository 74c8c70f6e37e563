"""``ctx.try_step``: a step whose failure is a value, not an exception.

The live price service is too slow: both attempts run past the step's timeout, so
``try_step`` returns a ``StepResult`` with ``ok=False`` and a ``failure`` of kind
"timeout", and the workflow falls back to a cached price. A coupon that is refused with
``NonRetryableError`` fails at once (kind "non_retryable", one attempt).
"""

from __future__ import annotations

import asyncio

from stepstream import Context, NonRetryableError, RetryPolicy, StepResult, workflow


async def live_price(sku: str) -> float:
    await asyncio.sleep(5)  # the service hangs; the attempt is cancelled at its timeout
    return 11.0


def cached_price(sku: str) -> float:
    return 12.5


def apply_coupon(code: str) -> float:
    if code == "WELCOME10":
        return 0.10
    raise NonRetryableError(f"coupon {code} has expired")


def _failure(r: StepResult[float]) -> dict[str, object] | None:
    if r.failure is None:
        return None
    return {"kind": r.failure.kind, "attempts": r.failure.attempts}


@workflow("try-step")
async def price(ctx: Context, order: dict[str, str]) -> dict[str, object]:
    live = await ctx.try_step(
        "live-price",
        live_price,
        order["sku"],
        timeout=0.1,
        retry=RetryPolicy(max_attempts=2, initial_interval=0.05),
    )
    amount = live.value if live.ok else await ctx.step("cached-price", cached_price, order["sku"])
    coupon = await ctx.try_step("coupon", apply_coupon, order["coupon"])
    discount = coupon.value if coupon.ok else 0.0
    return {
        "price": round(amount * (1 - discount), 2),
        "live": _failure(live),
        "coupon": _failure(coupon),
    }
