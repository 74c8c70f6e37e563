"""``ctx.loop``: a loop with carried state, ``Continue``/``Break``, and pruning.

A workflow polls a job until it is done. Each iteration is a scope (``poll/<i>/``), so
the body reuses its step names; ``Continue(state)`` records the state and runs the next
iteration, ``Break(value)`` ends the loop. Only the records of the last ``keep``
iterations are kept: replay starts at the last iteration, and a loop of a million
iterations holds as much history as one of ``keep``.
"""

from __future__ import annotations

from stepstream import Break, Context, Continue, workflow


def job_progress(check: int) -> int:
    return min(100, 5 * check)  # the job reports 5% more each time it is asked


@workflow("loop")
async def poll(ctx: Context, args: dict[str, int]) -> dict[str, int]:
    async def body(c: Context, checks: int) -> Continue[int] | Break[dict[str, int]]:
        progress = await c.step("check", job_progress, checks + 1)
        if progress >= 100:
            return Break({"checks": checks + 1, "progress": progress})
        await c.sleep("backoff", 0.005)
        return Continue(checks + 1)

    return await ctx.loop("poll", body, state=0, keep=args["keep"])
