"""The built-in workflow ``stepstream.schedule``: one durable instance per schedule.

A schedule is an instance like any other (id ``~schedule/<name>``), so its timers, a
kill -9, a new Kafka owner and the UI's instance view are the engine's. Its code is an
endless ``ctx.loop`` (few iterations kept, so history stays bounded) whose state is the
whole schedule: the spec, the next slot, paused or deleted, the instances it started
that still run, and its counters. Each iteration does one thing:

- a slot that is due and within the catch-up window starts ``<name>@<slot>`` (a child
  start: recorded, with an id and a command id that are functions of the slot, so a
  replay or a crash cannot start two), unless the overlap policy holds it back;
- a slot older than the catch-up window is skipped and counted, with all older ones;
- else it waits, until the next slot at most, for control messages (``schedule.set``,
  ``.pause``, ``.resume``, ``.trigger``, ``.delete``) and for the notices the instances
  it started send when they end (which ``overlap`` needs).

The started instances are its children only in that they report their end to it: a
delete stops the schedule and leaves them running.
"""

from __future__ import annotations

from typing import Any

from stepstream.engine.api.context import Context
from stepstream.engine.api.loops import Break, Continue
from stepstream.engine.api.messages import Message
from stepstream.engine.api.schedule_spec import (
    SCHEDULE_WORKFLOW,
    ScheduleSpec,
    check_spec,
    next_slot,
    skip_before,
    slot_instance_id,
)
from stepstream.engine.api.workflow import workflow
from stepstream.engine.errors import InvalidPayload
from stepstream.engine.replay.ids import child_event

SET, PAUSE, RESUME, TRIGGER, DELETE = (
    "schedule.set",
    "schedule.pause",
    "schedule.resume",
    "schedule.trigger",
    "schedule.delete",
)
CONTROL = (SET, PAUSE, RESUME, TRIGGER, DELETE)
LOOP = "schedule"
# Loop iterations whose records are kept: a schedule's history stays this short.
KEEP = 3
_BATCH = 100


def initial_state(spec: ScheduleSpec) -> dict[str, Any]:
    """The loop state of a schedule that has not run yet."""
    return {
        "spec": spec.to_json(),
        "next": None,  # the next slot, ms (None: not computed yet, paused or deleted)
        "paused": False,
        "deleted": False,
        "running": {},  # the end notice's event name -> the instance it started
        "buffered": None,  # a slot held back by overlap="buffer_one"
        "last_instance_id": None,
        "last_slot": None,
        "last_trigger": 0,
        "started": 0,
        "triggered": 0,
        "skipped_catchup": 0,
        "skipped_overlap": 0,
    }


@workflow(SCHEDULE_WORKFLOW)
async def run_schedule(ctx: Context, spec: dict[str, Any]) -> None:
    """Start the schedule's instances, one per slot, for as long as it exists."""
    state = initial_state(ScheduleSpec.from_json(spec))
    await ctx.loop(LOOP, _tick, state=state, keep=KEEP)


def _ms(ctx: Context) -> int:
    return round(ctx.now().timestamp() * 1000)


async def _tick(ctx: Context, s: dict[str, Any]) -> Continue[Any] | Break[Any]:
    spec = ScheduleSpec.from_json(s["spec"])
    now = _ms(ctx)
    active = not s["paused"] and not s["deleted"]
    if active and s["next"] is None:
        s["next"] = next_slot(spec, now)
        return Continue(s)
    if active and s["next"] <= now:
        slot = s["next"]
        limit = now - spec.catchup_window * 1000
        if slot < limit:  # the worker was down over it: too late to start
            skipped, s["next"] = skip_before(spec, slot, limit)
            s["skipped_catchup"] += skipped
            return Continue(s)
        s["next"] = next_slot(spec, slot)
        await _slot(ctx, spec, s, slot)
        return Continue(s)
    timeout = max(s["next"] - now, 0) / 1000 if active else None
    names = [*s["running"], *CONTROL]
    messages = await ctx.messages.next_batch(names, max=_BATCH, timeout=timeout)
    if messages:
        # The wait may have lasted hours: a resume, a new spec or a trigger counts from
        # when its message came, not from when the wait began.
        now = _ms(ctx)
    for message in messages:
        await _handle(ctx, s, message, now)
    return Continue(s)


async def _slot(ctx: Context, spec: ScheduleSpec, s: dict[str, Any], slot: int) -> None:
    if s["running"] and spec.overlap != "allow":
        if spec.overlap == "buffer_one" and s["buffered"] is None:
            s["buffered"] = slot
        else:
            s["skipped_overlap"] += 1
        return
    await _start(ctx, spec, s, slot_instance_id(spec.name, slot))
    s["last_slot"] = slot


async def _start(ctx: Context, spec: ScheduleSpec, s: dict[str, Any], instance_id: str) -> None:
    handle = await ctx.start_child(spec.workflow, spec.input, instance_id=instance_id, name="start")
    s["running"][child_event(handle.key)] = instance_id
    s["last_instance_id"] = instance_id
    s["started"] += 1


async def _handle(ctx: Context, s: dict[str, Any], message: Message, now: int) -> None:
    spec = ScheduleSpec.from_json(s["spec"])
    name = message.name
    if name in s["running"]:  # an instance it started ended
        del s["running"][name]
        if not s["running"] and s["buffered"] is not None and not s["paused"]:
            slot, s["buffered"] = s["buffered"], None
            await _start(ctx, spec, s, slot_instance_id(spec.name, slot))
            s["last_slot"] = slot
    elif name == PAUSE:
        s["paused"], s["next"] = True, None
    elif name == RESUME and s["paused"]:
        s["paused"] = False
        s["next"] = None if s["deleted"] else next_slot(spec, now)
        if not s["running"] and s["buffered"] is not None:
            slot, s["buffered"] = s["buffered"], None
            await _start(ctx, spec, s, slot_instance_id(spec.name, slot))
            s["last_slot"] = slot
    elif name == TRIGGER and not s["deleted"]:
        # Two triggers in one millisecond still start two instances.
        at = max(now, s["last_trigger"] + 1)
        s["last_trigger"] = at
        s["triggered"] += 1
        await _start(ctx, spec, s, slot_instance_id(spec.name, at, trigger=True))
    elif name == DELETE:
        s["deleted"], s["next"], s["buffered"] = True, None, None
    elif name == SET:
        _set(s, message.payload, now)


def _set(s: dict[str, Any], payload: Any, now: int) -> None:
    """A create of a schedule that exists: the new spec replaces the old one (and brings
    a deleted schedule back); the same spec again changes nothing."""
    current = ScheduleSpec.from_json(s["spec"])
    try:
        spec = check_spec(ScheduleSpec.from_json(dict(payload, name=current.name)))
    except (InvalidPayload, TypeError, ValueError):
        return  # clients check specs before sending; a bad one by hand changes nothing
    if spec == current and not s["deleted"]:
        return
    if s["deleted"]:
        s["paused"] = False
    s["spec"], s["deleted"] = spec.to_json(), False
    s["next"] = None if s["paused"] else next_slot(spec, now)
