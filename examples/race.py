"""``ctx.race``: the first branch to finish wins; the others are cancelled.

Two suppliers are asked for a quote against a deadline. The fast one answers first and
wins: the winner is recorded (replay returns it without running the race again), the
slow supplier's running attempt is given up (an async body is cancelled) and the
deadline's timer is cancelled. Give a deadline shorter than the fast supplier (say
``0.01``) and the deadline wins instead.
"""

from __future__ import annotations

import asyncio

from stepstream import Context, workflow


async def ask_supplier(name: str, seconds: float, price: float) -> dict[str, object]:
    await asyncio.sleep(seconds)  # the supplier's API taking its time
    return {"supplier": name, "price": price}


@workflow("race")
async def quote(ctx: Context, args: dict[str, float]) -> dict[str, object]:
    winner, value = await ctx.race(
        {
            "fast": lambda c: c.step("quote", ask_supplier, "fast", 0.05, 10.0),
            "slow": lambda c: c.step("quote", ask_supplier, "slow", 5.0, 9.0),
            "deadline": lambda c: c.sleep("deadline", args["deadline_s"]),
        }
    )
    return {"winner": winner, "quote": value}
