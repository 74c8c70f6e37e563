"""Schedules from a client: create, pause, resume, trigger, delete, describe, list.

A schedule is the instance ``~schedule/<name>`` of the built-in workflow
``stepstream.schedule`` (``engine.api.schedules``), so every call here is made of the
client calls every transport has: a create starts it (idempotent on the id) and sends
it the spec; the others send it a control message, durable once the call returns. A
description is read from the schedule's state, the last loop iteration in its history.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from stepstream.engine.api.schedule_spec import (
    SCHEDULE_ID_PREFIX,
    SCHEDULE_WORKFLOW,
    ScheduleSpec,
    check_spec,
    schedule_id,
)
from stepstream.engine.api.schedules import (
    DELETE,
    LOOP,
    PAUSE,
    RESUME,
    SET,
    TRIGGER,
    initial_state,
)
from stepstream.engine.errors import ConnectionFailed, InstanceFinished, UnknownInstance
from stepstream.engine.reads.listing import MAX_PAGE_SIZE, ListQuery
from stepstream.engine.wire.names import check_name

if TYPE_CHECKING:
    from stepstream.producers.client import Transport


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    """A schedule as its instance last recorded it."""

    name: str
    workflow: str
    spec: str  # "cron 0 2 * * * (UTC)" or "every 300s"
    paused: bool
    next_run_at: str | None  # UTC ISO 8601; None while paused, or before its first run
    last_instance_id: str | None
    cron: str | None = None
    every: int | None = None
    timezone: str = "UTC"
    overlap: str = "skip"
    catchup_window: int = 0
    input: Any = None
    running: list[str] = field(default_factory=list)  # instances it started that still run
    buffered_slot: str | None = None  # a slot overlap="buffer_one" holds back
    started: int = 0
    triggered: int = 0
    skipped: int = 0  # slots not started: skipped_catchup + skipped_overlap
    skipped_catchup: int = 0  # older than catchup_window when the schedule woke
    skipped_overlap: int = 0  # held back by the overlap policy
    status: str = "running"  # its instance's status (failed: see `stepstream status`)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ScheduleInfo:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


_ENDED = frozenset({"completed", "failed", "cancelled", "terminated"})


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat().replace("+00:00", "Z")


def info_of(state: dict[str, Any], status: str) -> ScheduleInfo:
    spec = ScheduleSpec.from_json(state["spec"])
    catchup, overlap = int(state["skipped_catchup"]), int(state["skipped_overlap"])
    return ScheduleInfo(
        name=spec.name,
        workflow=spec.workflow,
        spec=spec.text,
        paused=bool(state["paused"]),
        # An instance that ended (cancelled, failed) runs no slot again.
        next_run_at=None if status in _ENDED else _iso(state["next"]),
        last_instance_id=state["last_instance_id"],
        cron=spec.cron,
        every=spec.every,
        timezone=spec.timezone,
        overlap=spec.overlap,
        catchup_window=spec.catchup_window,
        input=spec.input,
        running=sorted(state["running"].values()),
        buffered_slot=_iso(state["buffered"]),
        started=int(state["started"]),
        triggered=int(state["triggered"]),
        skipped=catchup + overlap,
        skipped_catchup=catchup,
        skipped_overlap=overlap,
        status=status,
    )


async def create(transport: Transport, spec: ScheduleSpec) -> ScheduleInfo:
    """Create the schedule, or replace the spec of the one of that name (a deleted one
    comes back). Returns once the commands are durable."""
    check_spec(spec)
    instance_id = schedule_id(spec.name)
    # A schedule whose instance was cancelled, terminated or failed starts afresh.
    await transport.start(
        SCHEDULE_WORKFLOW, spec.to_json(), instance_id, None, if_exists="restart_if_failed"
    )
    await transport.send_event(instance_id, SET, spec.to_json(), None)
    return info_of(initial_state(spec), "pending")


async def control(transport: Transport, name: str, what: str) -> None:
    """Send the schedule ``name`` one of pause, resume, trigger, delete."""
    message = {"pause": PAUSE, "resume": RESUME, "trigger": TRIGGER, "delete": DELETE}[what]
    check_name(name, "schedule name")
    try:
        await describe(transport, name)  # UnknownInstance if there is none, or it was deleted
    except ConnectionFailed:
        pass  # nobody to read it from now: the message is durable, and a deleted one ignores it
    try:
        await transport.send_event(schedule_id(name), message, None, None)
    except UnknownInstance:
        raise _unknown(name) from None
    except InstanceFinished:
        raise InstanceFinished(
            f"schedule {name!r} does not run: its instance {schedule_id(name)} was "
            f"cancelled, terminated or failed (`stepstream status {schedule_id(name)}` says "
            f"which); `stepstream schedule create {name} ...` starts it again"
        ) from None


async def describe(transport: Transport, name: str) -> ScheduleInfo:
    """The schedule ``name`` (``UnknownInstance`` if there is none, or it was deleted)."""
    check_name(name, "schedule name")
    instance_id = schedule_id(name)
    try:
        status = await transport.status(instance_id)
        history = await transport.history(instance_id)
    except UnknownInstance:
        raise _unknown(name) from None
    state: dict[str, Any] | None = None
    for entry in history:
        if entry.type == "WorkflowStarted" and state is None:
            state = initial_state(ScheduleSpec.from_json(entry.attributes["input"]))
        elif entry.type == "LoopAdvanced" and entry.attributes.get("key") == LOOP:
            state = entry.attributes["state"]
    if state is None:
        raise _unknown(name)
    if state["deleted"]:
        raise _unknown(name, deleted=True)
    return info_of(state, status.status)


async def list_all(transport: Transport) -> list[ScheduleInfo]:
    """Every schedule that is not deleted, by name."""
    found: list[ScheduleInfo] = []
    after: str | None = None
    while True:
        page = await transport.list_page(
            ListQuery(None, SCHEDULE_WORKFLOW, SCHEDULE_ID_PREFIX, after, MAX_PAGE_SIZE)
        )
        for view in page.instances:
            try:
                found.append(await describe(transport, view.instance_id[len(SCHEDULE_ID_PREFIX) :]))
            except UnknownInstance:
                continue  # deleted
        if page.next is None:
            return found
        after = page.next


def _unknown(name: str, *, deleted: bool = False) -> UnknownInstance:
    why = "it was deleted" if deleted else "there is none"
    return UnknownInstance(
        f"no schedule named {name!r} ({why}); `stepstream schedule list` shows the "
        "schedules there are, and `stepstream schedule create` makes one"
    )
