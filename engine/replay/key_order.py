"""The entries' keys of one instance in sorted order, so the entries under a scope (a loop
iteration, a race's losing branches) are found by bisection, not by looking through every
entry. Built when first asked for (an instance without loops or races never needs it),
then kept as entries come and go."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping

from stepstream.engine.replay.entries import Entry


class KeyOrder:
    __slots__ = ("keys",)

    def __init__(self) -> None:
        # None until first asked for, and again after ``forget``.
        self.keys: list[str] | None = None

    def forget(self) -> None:
        """Every entry went at once (a restart): built again when next asked for."""
        self.keys = None

    def added(self, key: str) -> None:
        if self.keys is not None:
            insort(self.keys, key)

    def removed(self, gone: Iterable[str]) -> None:
        ordered = self.keys
        removed = set(gone)
        if ordered is None or not removed:
            return
        low = bisect_left(ordered, min(removed))
        high = bisect_left(ordered, max(removed)) + 1
        # The removed keys sit in one or a few runs: only that stretch is rebuilt.
        ordered[low:high] = [key for key in ordered[low:high] if key not in removed]

    def under(self, entries: Mapping[str, Entry], prefixes: Iterable[str]) -> list[Entry]:
        """The entries whose keys start with one of ``prefixes``, each once, in the order
        they were recorded: the cost follows what is found, not how many there are."""
        ordered = self.keys
        if ordered is None:
            ordered = self.keys = sorted(entries)
        found: dict[str, Entry] = {}
        for prefix in prefixes:
            at = bisect_left(ordered, prefix)
            while at < len(ordered) and ordered[at].startswith(prefix):
                key = ordered[at]
                found[key] = entries[key]
                at += 1
        return sorted(found.values(), key=_by_seq)


def _by_seq(entry: Entry) -> int:
    return entry.seq
