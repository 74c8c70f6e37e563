"""``RetryPolicy(max_attempts=None)``: a step that is retried for ever.

Some work must happen eventually, however long a dependency is down: with no attempt
limit the step never raises ``StepFailed`` for a failure; it backs off (capped at
``max_interval``) and tries again until a body returns. Here the inventory service
answers on the fourth attempt. A body that raises ``NonRetryableError`` still stops it.
"""

from __future__ import annotations

from stepstream import Context, RetryPolicy, workflow

FOR_EVER = RetryPolicy(max_attempts=None, initial_interval=0.05, backoff=2.0, max_interval=60)


@workflow("retry-forever")
async def sync_stock(ctx: Context, up_after: int) -> dict[str, int]:
    def push_inventory() -> int:
        if ctx.attempt < up_after:  # ctx.attempt: this attempt's number, from 1
            raise ConnectionError(f"inventory service down (attempt {ctx.attempt})")
        return ctx.attempt

    attempts = await ctx.step("push-inventory", push_inventory, retry=FOR_EVER)
    return {"attempts": attempts}
