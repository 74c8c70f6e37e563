"""Schedule slots: cron read in a time zone across DST days, interval slots, the slots a
late wake-up skips, and the specs a client is refused."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from stepstream import InvalidPayload
from stepstream.engine.api.schedule_spec import (
    ScheduleSpec,
    check_spec,
    next_slot,
    skip_before,
    slot_instance_id,
)


def ms(*args: int) -> int:
    return round(datetime(*args, tzinfo=UTC).timestamp() * 1000)  # type: ignore[misc]


def slots(spec: ScheduleSpec, after: int, n: int) -> list[str]:
    out = []
    for _ in range(n):
        after = next_slot(spec, after)
        out.append(slot_instance_id(spec.name, after))
    return out


def test_cron_in_a_zone_across_spring_forward() -> None:
    """02:30 does not exist in New York on 2026-03-08: that slot runs at 03:00 EDT."""
    spec = ScheduleSpec("n", "report", cron="30 2 * * *", timezone="America/New_York")
    assert slots(spec, ms(2026, 3, 7, 12), 3) == [
        "n@2026-03-08T07:00:00Z",
        "n@2026-03-09T06:30:00Z",
        "n@2026-03-10T06:30:00Z",
    ]


def test_cron_in_a_zone_across_fall_back_runs_once() -> None:
    """01:30 happens twice in New York on 2026-11-01: one slot, at the first."""
    spec = ScheduleSpec("n", "report", cron="30 1 * * *", timezone="America/New_York")
    assert slots(spec, ms(2026, 10, 31, 12), 3) == [
        "n@2026-11-01T05:30:00Z",
        "n@2026-11-02T06:30:00Z",
        "n@2026-11-03T06:30:00Z",
    ]


def test_every_slots_are_multiples_of_the_period() -> None:
    spec = ScheduleSpec("p", "poll", every=300)
    assert next_slot(spec, ms(2026, 1, 1, 10, 7)) == ms(2026, 1, 1, 10, 10)
    assert next_slot(spec, ms(2026, 1, 1, 10, 10)) == ms(2026, 1, 1, 10, 15)


@pytest.mark.parametrize(
    "spec",
    [ScheduleSpec("p", "poll", every=60), ScheduleSpec("c", "poll", cron="* * * * *")],
)
def test_a_late_wake_skips_the_slots_before_the_window(spec: ScheduleSpec) -> None:
    skipped, first = skip_before(spec, ms(2026, 1, 1, 0, 0), ms(2026, 1, 1, 1, 0))
    assert (skipped, first) == (60, ms(2026, 1, 1, 1, 0))


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"cron": "0 2 * * *", "every": 60}, "either cron= .* or every="),
        ({}, "either cron="),
        ({"cron": "0 25 * * *"}, "cron expression '0 25 \\* \\* \\*' is not valid"),
        ({"every": 0}, "at least 1"),
        ({"every": 60, "timezone": "Mars/Olympus"}, "unknown time zone"),
        ({"every": 60, "overlap": "queue"}, "skip, buffer_one, allow"),
        ({"every": 60, "catchup_window": 0}, "catchup_window"),
        ({"every": 60, "name": "a/b"}, "reserved in schedule names"),
    ],
)
def test_bad_specs_are_refused_with_what_to_do(changes: dict[str, object], says: str) -> None:
    fields: dict[str, object] = {"name": "n", "workflow": "report", **changes}
    with pytest.raises(InvalidPayload, match=says):
        check_spec(ScheduleSpec(**fields))  # type: ignore[arg-type]
