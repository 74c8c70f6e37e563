"""The queue's admission rule (``engine.api.queue_service``), on its own: whatever the
requests, releases and clock, it never holds more than ``concurrency``, never admits
more than ``rate`` in a window, admits by priority then arrival, and applies a repeated
request or release once. And ``Queue`` refuses limits it cannot keep."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepstream import Queue
from stepstream.engine.api.queue_service import admit, initial_state, take
from stepstream.engine.api.queues import QUEUE_ACQUIRE, QUEUE_RELEASE

# (instance number, acquire or release, ms to advance the clock)
Step = tuple[int, bool, int]


def request(n: int, priority: int = 0) -> dict[str, Any]:
    return {"instance": f"i-{n}", "key": "queue", "priority": priority}


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.integers(0, 400)), max_size=120),
    concurrency=st.integers(1, 4),
    rate=st.integers(1, 5),
)
def test_limits_hold_for_any_sequence(steps: list[Step], concurrency: int, rate: int) -> None:
    state = initial_state({"concurrency": concurrency, "rate": [rate, 1.0]})
    now = 0
    admissions: list[int] = []
    for n, acquire, advance in steps:
        now += advance
        take(state, QUEUE_ACQUIRE if acquire else QUEUE_RELEASE, request(n), now)
        admitted = admit(state, now)
        admissions += [now] * len(admitted)
        assert len(state["running"]) <= concurrency
        if state["waiting"] and len(state["running"]) < concurrency:
            # Held back by the rate only: the queue wakes when the window frees a slot.
            assert state["wake"] is not None and now < state["wake"] <= now + 1000
    for i, t in enumerate(admissions):
        assert sum(1 for u in admissions[i:] if u < t + 1000) <= rate


def test_priority_then_arrival_and_repeats_apply_once() -> None:
    state = initial_state({"concurrency": 1, "rate": None})
    take(state, QUEUE_ACQUIRE, request(0), 0)
    assert [i for i, _, _ in admit(state, 0)] == ["i-0"]
    for n, priority in ((1, 5), (2, 1), (3, 5), (4, 0), (5, 1)):
        take(state, QUEUE_ACQUIRE, request(n, priority), n)
        take(state, QUEUE_ACQUIRE, request(n, priority), n)  # published twice
    assert admit(state, 10) == []
    order = []
    holder = "i-0"
    while holder:
        take(state, QUEUE_RELEASE, {"instance": holder, "key": "queue"}, 20)
        take(state, QUEUE_RELEASE, {"instance": holder, "key": "queue"}, 20)  # twice
        admitted = admit(state, 20)
        holder = admitted[0][0] if admitted else ""
        order += [holder] if holder else []
    assert order == ["i-4", "i-2", "i-5", "i-1", "i-3"]


def test_a_rate_window_wakes_the_queue_when_it_frees_a_slot() -> None:
    state = initial_state({"concurrency": None, "rate": [2, 1.0]})
    for n in range(3):
        take(state, QUEUE_ACQUIRE, request(n), 0)
    assert len(admit(state, 100)) == 2
    assert state["wake"] == 1100  # the first admissions leave the window then
    assert admit(state, 1099) == []
    assert len(admit(state, 1100)) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "has no limit"),
        ({"concurrency": 0}, "concurrency must be a whole number of at least 1"),
        ({"rate": (0, 1.0)}, "rate must be"),
        ({"rate": (5, 0)}, "rate must be"),
    ],
)
def test_queue_refuses_limits_it_cannot_keep(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Queue("q", **kwargs)
    with pytest.raises(ValueError, match="must not contain '/'"):
        Queue("a/b", concurrency=1)
