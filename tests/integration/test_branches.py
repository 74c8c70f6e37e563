"""``ctx.join`` and ``ctx.race`` given what a list built at run time can hold: no
branches, or something that is not a branch."""

from __future__ import annotations

from typing import Any

from stepstream import Context, InvalidWorkflowCall, workflow
from stepstream.testing import WorkflowEnvironment


def _double(n: int) -> int:
    return 2 * n


async def test_a_join_of_no_branches_returns_nothing_and_uses_no_name() -> None:
    @workflow("fan")
    async def fan(ctx: Context, items: list[int]) -> Any:
        branches = {}
        for n in items:

            async def one(ctx: Context, n: int = n) -> int:
                return int(await ctx.step("double", _double, n))

            branches[f"item-{n}"] = one
        first = await ctx.join(branches)
        second = await ctx.join({"last": lambda ctx: ctx.step("double", _double, 5)})
        return [first, second]

    async with WorkflowEnvironment([fan], clock="virtual") as env:
        await env.client.start("fan", [], instance_id="none")
        await env.client.start("fan", [1], instance_id="one")
        assert await env.client.result("none", timeout=30) == [{}, {"last": 10}]
        assert await env.client.result("one", timeout=30) == [{"item-1": 2}, {"last": 10}]
        keys = [e.attributes.get("key") for e in await env.client.history("none")]
    assert "join/last/double" in keys  # the empty join took no name: this is "join"


async def test_a_race_of_nothing_and_branches_that_are_not_functions_are_refused() -> None:
    @workflow("bad-races")
    async def bad_races(ctx: Context, _: Any) -> Any:
        said = []
        for call, arg in [
            (ctx.race, {}),
            (ctx.race, ["a", "b"]),
            (ctx.join, {"a": "not a function"}),
            (ctx.join, {"a/b": _double}),
        ]:
            try:
                await call(arg)
            except InvalidWorkflowCall as exc:
                said.append(str(exc))
        return said

    async with WorkflowEnvironment([bad_races], clock="virtual") as env:
        await env.client.start("bad-races", None, instance_id="r-1")
        said = await env.client.result("r-1", timeout=30)
    assert said[0] == "ctx.race needs at least one branch: nothing can win none"
    assert said[1].startswith("ctx.race takes a dict of branch name -> async function(ctx)")
    assert said[2].startswith("ctx.join: branch 'a' is str 'not a function', not an async")
    assert said[3].startswith("ctx.join: branch name")
