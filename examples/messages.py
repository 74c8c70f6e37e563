"""``ctx.messages``: named queues of messages, taken in arrival order, in batches.

A newsroom posts stories to the digest's queue as messages named "story" (here the
workflow posts them to itself with ``ctx.messages.send``, as another instance would; a
client would use ``send_event`` or ``request``). Messages that arrive before anything
takes them wait in the queue. At press time the digest takes the first story as the lead
(``next``), then up to two stories at a time (``next_batch``), mailing one digest per
batch. Once no story has come for a moment, ``next_batch`` returns ``[]`` and the
workflow ends.

``price-desk`` answers requests: ``client.request(id, "quote", ...)`` sends a message
and waits for the value the workflow gives ``msg.complete``. Serve it with
``stepstream dev --workflows examples.messages``.
"""

from __future__ import annotations

from typing import Any

from stepstream import Context, workflow


def mail_digest(stories: list[str]) -> str:
    return " | ".join(stories)


@workflow("digest")
async def digest(ctx: Context, stories: list[str]) -> dict[str, Any]:
    for story in stories:  # recorded, published once, applied exactly once
        await ctx.messages.send(ctx.instance_id, "story", story)
    await ctx.sleep("press-time", 0.2)  # the stories queue up meanwhile
    lead = await ctx.messages.next("story")
    mailed: list[str] = []
    while batch := await ctx.messages.next_batch("story", max=2, timeout=0.2):
        mailed.append(await ctx.step("mail", mail_digest, [m.payload for m in batch]))
    return {"lead": lead.payload, "digests": mailed}


@workflow("price-desk")
async def price_desk(ctx: Context, prices: dict[str, float]) -> int:
    """Answers "quote" requests (``client.request``) until a "close" message comes;
    returns how many it answered."""
    answered = 0
    while True:
        msg = await ctx.messages.next(["quote", "close"])  # whichever comes first
        if msg.name == "close":
            return answered
        quote = msg.payload
        await msg.complete({"price": prices[quote["sku"]] * quote["qty"]})
        answered += 1
