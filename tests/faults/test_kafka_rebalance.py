"""Cooperative rebalancing, against the test broker with `stepstream worker` processes:
three workers own 12 partitions while workflows run on all of them; a fourth joins, then
one of the first three leaves. Only the partitions that change hands move (a fresh
fence, a higher epoch, nothing the old owner writes after it); the others are never
taken over again and keep writing history while the moved ones have no owner.

The scenario and what it reads from the topics are in ``tests/rebalance_probe.py``,
which also prints the timings of docs/kafka-notes.md; nothing here asserts a timing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import kafka_settings
from tests.kafka_broker import Broker
from tests.rebalance_probe import PARTITIONS, Phase, run_scenario

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def _check(phase: Phase, moving: int) -> None:
    detail = f"{phase.name}: {phase}"
    # Only the partitions that change hands move: 12 over 3 workers is 4 each, over 4 it
    # is 3 each, so a join moves one from each of three workers, a leave the leaver's 3.
    assert len(phase.moved) == moving, detail
    assert len(phase.stayed) == PARTITIONS - moving, detail
    # A partition that stayed was not revoked and taken over again (every take-over
    # appends a fence before anything else).
    assert phase.stayed_refenced == [], detail
    # It kept writing history while the moved partitions had no owner.
    assert all(n > 0 for n in phase.stayed_records_in_handover.values()), detail
    for partition in phase.moved:
        # A moved partition was taken over once, with an epoch above the one it had...
        assert len(phase.new_fences[partition]) == 1, detail
        assert phase.new_fences[partition][0] > phase.old_epochs[partition], detail
    # ... its old owner drained it before letting go: nothing of a lower epoch after the
    # fence, and no attempt lost in the hand-over.
    assert phase.late_writes == 0, detail
    assert phase.attempts_lost == 0, detail


async def test_a_join_and_a_leave_move_only_the_partitions_that_change_hands(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    report = await run_scenario(kafka_settings(kafka_broker), tmp_path)
    join, leave = report.phases
    _check(join, moving=3)
    assert len({new for _old, new in join.moved.values()}) == 1  # all to the newcomer
    assert len({old for old, _new in join.moved.values()}) == 3  # one from each
    _check(leave, moving=3)
    assert len({old for old, _new in leave.moved.values()}) == 1  # all from the leaver
    assert len({new for _old, new in leave.moved.values()}) == 3  # one to each survivor
    assert report.duplicate_successes == []
