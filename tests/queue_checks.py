"""What the queue tests check, from recorded history: when each slot was admitted (the
time the queue decided, carried in the admission) and when it was given back (the
holder's release record), and from those the most slots ever held at once and the most
admissions in any rate window."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from stepstream import HistoryEntry
from stepstream.engine.api.queues import asked_slot


def _ms(iso: str) -> int:
    return round(datetime.fromisoformat(iso).timestamp() * 1000)


def slot_spans(history: Sequence[HistoryEntry], slot: str = "queue") -> list[tuple[int, int]]:
    """(admitted at ms, released at ms) of each slot of one instance whose replay key is
    ``slot`` or ends with ``/<slot>`` or ``#slot`` (a step's: one per attempt)."""
    admitted: dict[str, int] = {}
    released: dict[str, int] = {}
    for entry in history:
        key = str(entry.attributes.get("key", ""))
        if entry.type == "MessagesReceived" and _held(key, slot):
            admitted[key] = int(entry.attributes["payloads"][0]["admitted_ms"])
        elif key.endswith("#release") and _held(key.removesuffix("#release"), slot):
            if entry.type == "MessageSent":
                released[key.removesuffix("#release")] = _ms(entry.time)
    assert admitted.keys() == released.keys(), (admitted, released, history)
    return [(admitted[k], released[k]) for k in admitted]


def _held(key: str, slot: str) -> bool:
    """Whether ``key`` is a slot's wait; a queued step's later attempts ask again with
    ``<step>#slot#<attempt>``, and a slot a reset gave back with ``<slot>#ask<n>``."""
    key = asked_slot(key)[0]
    if slot == "#slot":
        head, _, tail = key.rpartition("#")
        if tail.isdigit() and head.endswith("#slot"):
            return True
    return key.endswith(slot)


def most_at_once(spans: Iterable[tuple[int, int]]) -> int:
    """The most spans open at one moment; a release at the very ms of an admission
    counts first (the queue took the release before it admitted)."""
    events = sorted([(a, 1) for a, _ in spans] + [(r, -1) for _, r in spans])
    most = held = 0
    for _, change in events:
        held += change
        most = max(most, held)
    return most


def most_per_window(admissions: Iterable[int], window_ms: int) -> int:
    """The most admissions in any window [t, t + window_ms)."""
    times = sorted(admissions)
    most = 0
    first = 0
    for last, t in enumerate(times):
        while times[first] <= t - window_ms:
            first += 1
        most = max(most, last - first + 1)
    return most
