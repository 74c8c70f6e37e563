"""What a loop's ``keep=`` prunes from an instance's state as it advances: the entries of
its iterations older than the last ``keep``, and the stretch of stored history that
recorded them (``InstanceState.pruned_history``), so a long-running loop's state and
history stay the size of its last iterations."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stepstream.engine.replay.entries import Entry
from stepstream.engine.replay.ids import loop_prefixes
from stepstream.engine.wire.records import LoopAdvanced

if TYPE_CHECKING:
    from stepstream.engine.replay.state import InstanceState


def prune_iterations(state: InstanceState, entry: Entry, record: LoopAdvanced) -> None:
    """Fold ``record`` (the loop ``entry`` ended an iteration) into what is pruned."""
    ended = record.iteration - 1
    marks = entry.marks = entry.marks or {}
    marks[ended] = record.seq
    # Iterations below ``before`` are pruned; ``max_attempts`` keeps how far it got.
    before = max(record.iteration - max(record.keep, 1), 0)
    if before <= entry.max_attempts:
        return
    pruned = state.under(
        [p for j in range(entry.max_attempts, before) for p in loop_prefixes(record.key, j)]
    )
    # The stored history from just after the last pruned iteration (or the first
    # record of these) through the LoopAdvanced that ended iteration ``before - 1``.
    boundary = marks.get(entry.max_attempts - 1)
    starts = [e.seq for e in pruned] + [
        marks[j] for j in range(entry.max_attempts, before) if j in marks
    ]
    low = boundary + 1 if boundary is not None else min(starts, default=record.seq)
    high = marks.get(before - 1, low - 1) + 1
    state.drop(pruned)
    for j in [j for j in marks if j < before - 1]:
        del marks[j]
    if high > low:
        state.pruned_history.append((low, high))
    entry.max_attempts = before
