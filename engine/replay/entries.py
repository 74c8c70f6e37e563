"""What an instance's history says about each of its replay keys: the entries of
``InstanceState`` (a step, a sleep, a wait, a race ...), their kinds and states, and the
events buffered until a wait takes them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from stepstream.engine.wire.records import Payload


class EntryKind(StrEnum):
    STEP = "step"
    SLEEP = "sleep"
    WAIT = "wait"
    VALUE = "value"
    RACE = "race"
    LOOP = "loop"
    CHILD = "child"
    SENT = "sent"  # a message sent to another instance


class EntryState(StrEnum):
    RUNNING = "running"  # step attempt in flight
    BACKOFF = "backoff"  # step waiting for its retry timer
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SLEEPING = "sleeping"
    ELAPSED = "elapsed"
    WAITING = "waiting"
    SATISFIED = "satisfied"
    TIMED_OUT = "timed_out"
    RECORDED = "recorded"
    ABANDONED = "abandoned"  # what a losing race branch was doing when the race ended

    @property
    def final(self) -> bool:
        return self not in _OPEN_ENTRY_STATES


_OPEN_ENTRY_STATES = frozenset(
    {EntryState.RUNNING, EntryState.BACKOFF, EntryState.SLEEPING, EntryState.WAITING}
)


@dataclass(slots=True)
class Entry:
    """What the history says about one replay key."""

    key: str
    kind: EntryKind
    state: EntryState
    seq: int
    attempt: int = 0
    max_attempts: int = 0
    result: Payload | None = None
    error_type: str = ""
    error_message: str = ""
    timer_id: str | None = None
    fire_at_ms: int | None = None
    event_name: str | None = None
    winner: str | None = None  # a race's winning branch
    losers: list[str] | None = None  # a race's losing branches, as scope prefixes
    # A loop's kept iterations: iteration -> seq of the LoopAdvanced that ended it.
    marks: dict[int, int] | None = None
    child_id: str | None = None  # a child workflow's instance id (its input in result)
    # A message wait: the names it takes (``max_attempts``: how many at most), and once
    # satisfied the messages it took: (id, name, payload, arrived at ms).
    names: list[str] | None = None
    messages: list[tuple[str, str, Payload, int]] | None = None

    @property
    def waited_names(self) -> list[str]:
        """The event or message names a wait takes (an event wait: its one name)."""
        return self.names if self.names is not None else [self.event_name or ""]


@dataclass(slots=True)
class BufferedEvent:
    name: str
    payload: Payload
    command_id: str
    seq: int
    time_ms: int = 0  # when it reached the instance
