"""Hooks: alert on failed step attempts, keep an audit trail of status changes.

    stepstream run examples.hooks:payout --input '{"account": "acc-1", "amount": 25}'

The bank call fails twice before it goes through; ``alert`` logs each failed attempt
(with when the retry is due) and ``audit`` each status change of the instance.
"""

from __future__ import annotations

import logging

from stepstream import (
    Context,
    RetryPolicy,
    StatusChangeEvent,
    StepErrorEvent,
    workflow,
)

log = logging.getLogger("examples.hooks")


def alert(event: StepErrorEvent) -> None:
    """Sync: runs on a hook thread, so a slow pager call holds up nothing."""
    when = f"retry at {event.retry_at:%H:%M:%S}" if event.will_retry else "gave up"
    log.warning(
        "%s/%s step %s attempt %d failed (%s: %s); %s",
        event.workflow,
        event.instance_id,
        event.step,
        event.attempt,
        event.error_type,
        event.message,
        when,
    )


async def audit(event: StatusChangeEvent) -> None:
    """Async: runs on the engine's loop (await your client library here)."""
    log.warning(
        "%s %s: %s -> %s%s",
        event.at.isoformat(timespec="milliseconds"),
        event.instance_id,
        event.old_status,
        event.new_status,
        f" ({event.error})" if event.error else "",
    )


def transfer(ctx: Context, account: str, amount: float) -> str:
    if ctx.attempt < 3:
        raise ConnectionError("the bank did not answer")
    return f"tx-{account}-{amount:g}"


@workflow("payout", version="1", on_error=alert, on_status_change=audit)
async def payout(ctx: Context, request: dict[str, object]) -> str:
    account, amount = str(request["account"]), float(request["amount"])  # type: ignore[arg-type]
    return await ctx.step(
        "transfer",
        transfer,
        ctx,
        account,
        amount,
        retry=RetryPolicy(max_attempts=5, initial_interval=0.2),
    )
