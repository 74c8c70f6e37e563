"""The fields of a request body, checked the same way for an HTTP route and a session
call: exact field names, non-empty strings, a start's place in its queue. Each failure is
an ``InvalidPayload`` naming the field and what it must be."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stepstream.engine.errors import InvalidPayload
from stepstream.engine.wire.names import whole_number_problem


def string_field(body: dict[str, Any], name: str, *, allow_empty: bool = False) -> str:
    value = body.get(name)
    if not isinstance(value, str) or (not value and not allow_empty):
        kind = "a string" if allow_empty else "a non-empty string"
        raise InvalidPayload(f"field {name!r} must be {kind}, got {value!r}")
    return value


def check_fields(
    given: Iterable[str], required: tuple[str, ...], optional: tuple[str, ...], *, what: str
) -> None:
    """Exactly the fields a route or call knows about: a missing or unknown one (a typo
    that would silently drop an ``event_id``) is refused, naming the known ones."""
    names = set(given)
    missing = [name for name in required if name not in names]
    unknown = sorted(names - {*required, *optional})
    if missing or unknown:
        known = ", ".join((*required, *optional)) or "none"
        problems = [f"missing {', '.join(missing)}"] if missing else []
        problems += [f"unknown {', '.join(unknown)}"] if unknown else []
        raise InvalidPayload(f"{what} fields: {'; '.join(problems)} (fields: {known})")


def queue_fields(body: dict[str, Any]) -> dict[str, Any]:
    """A start's place in its workflow's queue: ``priority`` (a whole number, lower
    first) and ``queue_key`` (a per_key queue's key), each optional."""
    priority = body.get("priority")
    problem = None if priority is None else whole_number_problem(priority)
    if problem is not None:
        raise InvalidPayload(f"field 'priority' {problem}")
    queue_key = string_field(body, "queue_key") if body.get("queue_key") is not None else None
    return {"priority": priority, "queue_key": queue_key}
