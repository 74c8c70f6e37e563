"""ctx.patched and ctx.removed: changing a workflow under the same version without
breaking the instances that are running it. An instance started by the old code is
replayed by the new code (a crash, a new owner, a deploy) and must go on along the old
path; an instance started by the new code takes the new one."""

from __future__ import annotations

from typing import Any

from stepstream.engine.api.context import Context
from tests.unit.test_runtime import Harness, define, ident


async def _old(ctx: Context, _: Any) -> Any:
    await ctx.step("audit", ident, "audited")
    got = await ctx.wait_for_event("go")
    return ["old", got]


async def _new(ctx: Context, _: Any) -> Any:
    ctx.removed("audit")  # the new code no longer audits
    if ctx.patched("fraud-check"):
        checked = await ctx.step("fraud", ident, "clean")
        got = await ctx.wait_for_event("go")
        return ["new", checked, got]
    got = await ctx.wait_for_event("go")
    return ["old", got]


def test_an_old_instance_replays_on_the_old_path_and_a_new_one_takes_the_new() -> None:
    old = Harness(define("order", _old), instance_id="old-1")
    old.start(None)
    old.run_all()  # audited, now waiting for "go"
    old.definition = define("order", _new)  # the deploy
    old.crash()  # replayed by the new code: no divergence
    assert old.state.parked == ""
    old.send("go", 1)
    old.run_all()
    assert old.result() == ["old", 1]
    assert "fraud" not in old.state.entries

    new = Harness(define("order", _new), instance_id="new-1")
    new.start(None)
    new.run_all()
    new.crash()  # the patch is recorded: replay takes the new path again
    new.send("go", 2)
    new.run_all()
    assert new.result() == ["new", "clean", 2]
    assert "audit" not in new.state.entries


async def _patch_dropped(ctx: Context, _: Any) -> Any:
    checked = await ctx.step("fraud", ident, "clean")  # the patch is now the only path
    got = await ctx.wait_for_event("go")
    return ["new", checked, got]


def test_dropping_a_patch_later_does_not_break_instances_that_recorded_it() -> None:
    h = Harness(define("order", _new), instance_id="n-2")
    h.start(None)
    h.run_all()
    h.definition = define("order", _patch_dropped)
    h.crash()
    h.send("go", 3)
    h.run_all()
    assert h.result() == ["new", "clean", 3]
