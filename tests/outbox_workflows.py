"""Workflows that publish with ``ctx.publish``, for the outbox tests.

Importable by worker subprocesses (``--workflows tests.outbox_workflows``). With
``STEPSTREAM_TEST_OUTBOX_KILL=<point>:<i>`` the process kills itself (SIGKILL) when the
publish of record ``i`` of ``outbox-many`` reaches ``point``:

- ``before-produce``: its attempt is durable, nothing is produced yet;
- ``after-ack``: the broker acknowledged the record, its outcome is not recorded yet;
- ``after-commit``: its outcome is durable (in the body of the step that follows it).

Before dying it writes ``<point> <i>`` to ``$STEPSTREAM_TEST_OUTBOX_NOTES/killed``, so a
test knows the kill came where it meant it to.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from stepstream import Break, Context, Continue, workflow

KILL_ENV = "STEPSTREAM_TEST_OUTBOX_KILL"
NOTES_ENV = "STEPSTREAM_TEST_OUTBOX_NOTES"


@workflow("outbox-order")
async def outbox_order(ctx: Context, order: dict[str, Any]) -> dict[str, Any]:
    topic = order["topic"]
    first = await ctx.publish(
        topic,
        {"order": ctx.instance_id, "total": order["total"]},
        key=ctx.instance_id,
        headers={"kind": "confirmed", "raw": b"\x00\x01"},
    )
    ids = [first.id]
    for line in range(2):  # one name twice: two replay keys, two ids
        ids.append((await ctx.publish(topic, f"line {line}".encode(), key=b"lines")).id)
    async with ctx.scope("ship"):
        ids.append((await ctx.publish(topic, {"shipped": True})).id)

    async def remind(c: Context, sent: list[str]) -> Continue | Break:
        sent = [*sent, (await c.publish(topic, {"reminder": len(sent)})).id]
        return Continue(sent) if len(sent) < 2 else Break(sent)

    ids.extend(await ctx.loop("remind", remind, state=[]))  # each iteration a scope
    return {"ids": ids, "first": [first.topic, first.partition, first.offset]}


@workflow("outbox-bad")
async def outbox_bad(ctx: Context, case: str) -> None:
    if case == "topic":
        await ctx.publish("orders/confirmed", {"ok": True})
    elif case == "value":
        await ctx.publish("orders", {"not", "json"})
    elif case == "header":
        await ctx.publish("orders", {"ok": True}, headers={"stepstream-id": "mine"})
    else:
        await ctx.publish(case, {"ok": True})  # a valid name: the topic may be missing


def _die(point: str, index: int) -> None:
    notes = os.environ.get(NOTES_ENV)
    if notes:
        (Path(notes) / "killed").write_text(f"{point} {index}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_point() -> tuple[str, int] | None:
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return None
    point, _, index = spec.partition(":")
    return point, int(index)


def _after(index: int) -> int:
    if _kill_point() == ("after-commit", index):
        _die("after-commit", index)
    return index


@workflow("outbox-many")
async def outbox_many(ctx: Context, spec: dict[str, Any]) -> int:
    for index in range(spec["n"]):
        await ctx.publish(spec["topic"], {"i": index}, key=str(index))
        await ctx.step("after", _after, index)
    return int(spec["n"])


def _install_kill_points() -> None:
    """Wraps the outbox's producer call (the real one) with the kill points around it."""
    if _kill_point() is None:
        return
    from stepstream.consumers.kafka.outbox import KafkaOutbox
    from stepstream.engine.api.outbox import OutboxRecord

    produce = KafkaOutbox.publish

    async def publish(self: KafkaOutbox, record: OutboxRecord) -> tuple[int, int]:
        index = json.loads(record.value).get("i")
        if _kill_point() == ("before-produce", index):
            _die("before-produce", index)
        landed = await produce(self, record)
        if _kill_point() == ("after-ack", index):
            _die("after-ack", index)
        return landed

    KafkaOutbox.publish = publish  # type: ignore[method-assign]


_install_kill_points()
