"""What a schedule is: its spec (cron or every, time zone, overlap, catch-up window),
checked once where a client creates it, and the slots it has, as pure functions of the
spec and an instant, so the schedule workflow computes them the same way on replay.

A slot is a UTC instant in milliseconds. A cron expression is read in the spec's time
zone (``cronsim``, with ``zoneinfo``), so on a DST day a slot that does not exist runs
at the first instant after the gap and one that exists twice runs once. ``every``
slots are whole multiples of the period since the Unix epoch, so they do not depend on
when the schedule was created.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from stepstream.engine.api.durations import MAX_DURATION_S
from stepstream.engine.errors import InvalidPayload
from stepstream.engine.wire.names import check_name, name_problem, whole_in

SCHEDULE_WORKFLOW = "stepstream.schedule"
# Schedule instances are named with this prefix; clients may not start ids that have it.
SCHEDULE_ID_PREFIX = "~schedule/"
OVERLAP_POLICIES = ("skip", "buffer_one", "allow")
DEFAULT_CATCHUP_WINDOW = 3600
# A schedule's name leaves room in an instance id for "@" and a slot time.
MAX_SCHEDULE_NAME = 200
# Slots counted one by one when a worker was down over many (a month of minutes).
_MAX_SLOT_STEPS = 100_000


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """A schedule as created: ``cron`` or ``every`` (seconds), never both."""

    name: str
    workflow: str
    input: Any = None
    cron: str | None = None
    every: int | None = None
    timezone: str = "UTC"
    overlap: str = "skip"
    catchup_window: int = DEFAULT_CATCHUP_WINDOW

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ScheduleSpec:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})

    @property
    def text(self) -> str:
        """The spec in one line: ``cron 0 2 * * * (UTC)`` or ``every 300s``."""
        if self.cron is not None:
            return f"cron {self.cron} ({self.timezone})"
        return f"every {self.every}s"


def schedule_id(name: str) -> str:
    """The instance id of the schedule ``name``."""
    return f"{SCHEDULE_ID_PREFIX}{name}"


def scheduled_workflow(workflow: str, input: Any) -> str | None:
    """The workflow a start of ``workflow`` with ``input`` makes a schedule of (None for
    any other start): a client refuses a schedule of a workflow no worker has, as it
    refuses a start of it."""
    if workflow != SCHEDULE_WORKFLOW or not isinstance(input, dict):
        return None
    scheduled = input.get("workflow")
    return scheduled if isinstance(scheduled, str) else None


def check_spec(spec: ScheduleSpec) -> ScheduleSpec:
    """``spec`` if it is a schedule that can run, else ``InvalidPayload`` saying what to
    change."""
    check_name(spec.name, "schedule name", _schedule_name_problem)
    check_name(spec.workflow, f"workflow of schedule {spec.name!r}:")
    if (spec.cron is None) == (spec.every is None):
        raise InvalidPayload(
            f"schedule {spec.name!r}: give either cron= (a cron expression such as "
            "'0 2 * * *') or every= (seconds), not both and not neither"
        )
    if spec.every is not None and not whole_in(spec.every, 1, MAX_DURATION_S):
        raise InvalidPayload(
            f"schedule {spec.name!r}: every={spec.every!r} must be a whole number of "
            f"seconds, at least 1 and at most {MAX_DURATION_S} (100 years)"
        )
    zone = _zone(spec)
    if spec.cron is not None:
        try:
            CronSim(spec.cron, datetime(2000, 1, 1, tzinfo=zone))
        except CronSimError as exc:
            raise InvalidPayload(
                f"schedule {spec.name!r}: cron expression {spec.cron!r} is not valid: {exc}; "
                "use five fields: minute hour day-of-month month day-of-week"
            ) from None
    if spec.overlap not in OVERLAP_POLICIES:
        raise InvalidPayload(
            f"schedule {spec.name!r}: overlap={spec.overlap!r} is not a policy; use one of "
            + ", ".join(OVERLAP_POLICIES)
        )
    window = spec.catchup_window
    if not whole_in(window, 1, MAX_DURATION_S):
        raise InvalidPayload(
            f"schedule {spec.name!r}: catchup_window={window!r} must be a whole number of "
            f"seconds, at least 1 and at most {MAX_DURATION_S} (how late a slot may still "
            "start)"
        )
    return spec


def _schedule_name_problem(value: object) -> str | None:
    problem = name_problem(value)
    if problem is not None:
        return problem
    assert isinstance(value, str)
    if len(value.encode()) > MAX_SCHEDULE_NAME:
        return f"is over {MAX_SCHEDULE_NAME} bytes (its instances are named '<name>@<time>')"
    if "/" in value or "@" in value:
        return "contains '/' or '@', which are reserved in schedule names"
    return None


def _zone(spec: ScheduleSpec) -> ZoneInfo:
    try:
        return ZoneInfo(spec.timezone)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise InvalidPayload(
            f"schedule {spec.name!r}: unknown time zone {spec.timezone!r}; use an IANA "
            "name such as 'UTC' or 'Europe/Paris'"
        ) from None


def next_slot(spec: ScheduleSpec, after_ms: int) -> int:
    """The first slot strictly after ``after_ms``."""
    if spec.every is not None:
        period = spec.every * 1000
        return (after_ms // period + 1) * period
    assert spec.cron is not None
    zone = ZoneInfo(spec.timezone)
    # cronsim starts from the next whole minute after the instant it is given.
    start = datetime.fromtimestamp(after_ms / 1000, tz=UTC).astimezone(zone)
    for found in CronSim(spec.cron, start):
        ms = round(found.timestamp() * 1000)
        if ms > after_ms:
            return ms
    raise InvalidPayload(f"schedule {spec.name!r}: cron {spec.cron!r} has no next slot")


def skip_before(spec: ScheduleSpec, slot_ms: int, limit_ms: int) -> tuple[int, int]:
    """(how many slots from ``slot_ms`` on are before ``limit_ms``, the first slot at or
    after it): the slots a schedule skips when it wakes later than its catch-up window."""
    if spec.every is not None:
        period = spec.every * 1000
        first = -(-limit_ms // period) * period  # the first multiple >= limit_ms
        return (first - slot_ms) // period, first
    skipped, slot = 0, slot_ms
    while slot < limit_ms and skipped < _MAX_SLOT_STEPS:
        skipped += 1
        slot = next_slot(spec, slot)
    if slot < limit_ms:  # beyond counting: start over from the limit
        slot = next_slot(spec, limit_ms - 1)
    return skipped, slot


def slot_text(ms: int, *, precise: bool = False) -> str:
    """An instant as UTC ISO 8601: ``2026-03-08T07:00:00Z`` for a slot (always whole
    seconds), ``2026-03-08T07:00:00.000Z`` with ``precise`` (a trigger's time), so a
    trigger's id never takes a slot's."""
    moment = datetime.fromtimestamp(ms / 1000, tz=UTC)
    spec = "milliseconds" if precise else "seconds"
    return moment.isoformat(timespec=spec).replace("+00:00", "Z")


def slot_instance_id(name: str, ms: int, *, trigger: bool = False) -> str:
    """The id of the instance the schedule ``name`` starts for the slot ``ms`` (or for a
    trigger at ``ms``)."""
    return f"{name}@{slot_text(ms, precise=trigger)}"
