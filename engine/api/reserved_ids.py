"""Instance ids the engine keeps for its own instances: ``~schedule/<name>`` (a schedule,
of ``stepstream.schedule``) and ``~queue/<name>[/<key>]`` (a queue, of
``stepstream.queue``). A start of another workflow under one, or a fork into one, is
refused wherever commands are checked: it would stand where the engine's instance must,
and the schedule or queue would stop."""

from __future__ import annotations

from stepstream.engine.api.queues import QUEUE_INSTANCE_PREFIX, QUEUE_WORKFLOW
from stepstream.engine.api.schedule_spec import SCHEDULE_ID_PREFIX, SCHEDULE_WORKFLOW

_RESERVED = (
    (SCHEDULE_ID_PREFIX, SCHEDULE_WORKFLOW, "schedules"),
    (QUEUE_INSTANCE_PREFIX, QUEUE_WORKFLOW, "queues"),
)


def reserved_id_problem(instance_id: str, workflow: str | None = None) -> str | None:
    """Why an instance of ``workflow`` (None: a fork, of any) may not have this id."""
    for prefix, owner, what in _RESERVED:
        if instance_id.startswith(prefix) and workflow != owner:
            return f"starts with {prefix!r}, which is reserved for {what}"
    return None


def is_engine_instance(instance_id: str) -> bool:
    """Whether ``instance_id`` is one the engine keeps for a schedule or a queue."""
    return instance_id.startswith(tuple(prefix for prefix, _, _ in _RESERVED))
