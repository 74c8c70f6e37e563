"""Child workflows: ``ctx.start_child`` and ``handle.result()``.

A batch of photos is resized by splitting it in two halves, each a child workflow of its
own (``<parent id>/left`` and ``<parent id>/right``, which may live on another partition
and worker). The parent starts both at once, then awaits both handles. A child is the
same workflow with half the batch (two photos or fewer it resizes itself), so
``stepstream run``, which serves only the workflow it runs, runs the children too. A photo that
cannot be read fails its child; the parent catches ``ChildFailed`` and reports which
half failed and why: add ``"broken.png"`` to the batch to see it.
"""

from __future__ import annotations

from typing import Any

from stepstream import ChildFailed, Context, NonRetryableError, workflow


def shrink(photo: str) -> str:
    if photo.startswith("broken"):
        raise NonRetryableError(f"{photo} is not an image")
    return photo.replace(".", "-small.")


@workflow("resize")
async def resize(ctx: Context, photos: list[str]) -> dict[str, Any]:
    if len(photos) <= 2:  # small enough to do here, one step per photo
        return {"resized": [await ctx.step("shrink", shrink, photo) for photo in photos]}
    half = len(photos) // 2
    children = {
        "left": await ctx.start_child("resize", photos[:half], name="left"),
        "right": await ctx.start_child("resize", photos[half:], name="right"),
    }
    resized: list[str] = []
    failed: dict[str, str] = {}
    for side, handle in children.items():
        try:
            resized += (await handle.result())["resized"]
        except ChildFailed as exc:
            failed[side] = f"{exc.status}: {exc.error}"
    return {"resized": resized, "failed": failed} if failed else {"resized": resized}
