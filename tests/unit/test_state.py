"""InstanceState: the status machine, folding records, and the stored form."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepstream.engine.reads.views import InstanceStatus
from stepstream.engine.replay.ids import timer_id
from stepstream.engine.replay.state import (
    RECENT_COMMANDS,
    BufferedEvent,
    Entry,
    EntryKind,
    EntryState,
    InstanceState,
    InvalidTransition,
    Status,
)
from stepstream.engine.replay.state_json import (
    buffered_json,
    entry_from_json,
    entry_json,
    meta_json,
    payload_bytes,
    state_from_storage,
)
from stepstream.engine.wire.records import (
    CommandIgnored,
    EventBuffered,
    HistoryRecord,
    LoopAdvanced,
    MessagesReceived,
    MessageWaitStarted,
    Payload,
    RaceDecided,
    SleepElapsed,
    SleepStarted,
    StepAttemptStarted,
    StepFailedRecord,
    StepSucceeded,
    ValueRecorded,
    WaitSatisfied,
    WaitStarted,
    WaitTimedOut,
    WorkflowCancelledRecord,
    WorkflowCompleted,
    WorkflowFailedRecord,
    WorkflowPaused,
    WorkflowResumed,
    WorkflowStarted,
)

ID = "inst-1"
T0 = 1_700_000_000_000


def pj(value: str) -> Payload:
    return Payload("application/json", value.encode())


class Recorder:
    """Builds records with consecutive seqs, the way one instance's history grows."""

    def __init__(self) -> None:
        self._seq = itertools.count(1)

    def __call__(self, cls: type[HistoryRecord], command_id: str = "c", **attrs: Any) -> Any:
        seq = next(self._seq)
        return cls(instance_id=ID, seq=seq, time_ms=T0 + seq, command_id=command_id, **attrs)


def started(rec: Recorder) -> HistoryRecord:
    return rec(WorkflowStarted, "start", workflow="wf", version="2", input=pj("1"))


def fold(records: list[HistoryRecord]) -> InstanceState:
    state = InstanceState(ID)
    for record in records:
        state.apply(record)
    return state


# ---- the status machine ---------------------------------------------------------------

_VALID = {
    (Status.PENDING, Status.RUNNING),
    (Status.PENDING, Status.PAUSED),
    (Status.PENDING, Status.COMPLETED),
    (Status.PENDING, Status.FAILED),
    (Status.PENDING, Status.CANCELLED),
    (Status.RUNNING, Status.PAUSED),
    (Status.RUNNING, Status.COMPLETED),
    (Status.RUNNING, Status.FAILED),
    (Status.RUNNING, Status.CANCELLED),
    (Status.PAUSED, Status.RUNNING),
    (Status.PAUSED, Status.PENDING),
    (Status.PAUSED, Status.FAILED),
    (Status.PAUSED, Status.CANCELLED),
    (Status.PENDING, Status.TERMINATED),
    (Status.RUNNING, Status.TERMINATED),
    (Status.PAUSED, Status.TERMINATED),
    # A restart (WorkflowRestarted) begins a new run of an instance that ended so.
    (Status.FAILED, Status.PENDING),
    (Status.CANCELLED, Status.PENDING),
    (Status.TERMINATED, Status.PENDING),
}
_MOVES = [(a, b) for a in Status for b in Status if a is not b]


@pytest.mark.parametrize(("source", "target"), sorted(_VALID))
def test_valid_transitions(source: Status, target: Status) -> None:
    state = InstanceState(ID, status=source)
    state._transition_to(target)
    assert state.status is target


@pytest.mark.parametrize(("source", "target"), [m for m in _MOVES if m not in _VALID])
def test_invalid_transitions_raise_and_change_nothing(source: Status, target: Status) -> None:
    state = InstanceState(ID, status=source)
    with pytest.raises(InvalidTransition, match=f"{ID}: {source.value} -> {target.value}"):
        state._transition_to(target)
    assert state.status is source


@pytest.mark.parametrize("status", list(Status))
def test_transition_to_the_same_status_is_a_no_op(status: Status) -> None:
    state = InstanceState(ID, status=status)
    state._transition_to(status)
    assert state.status is status


def test_finished_statuses() -> None:
    assert {s for s in Status if s.finished} == {
        Status.COMPLETED,
        Status.FAILED,
        Status.CANCELLED,
        Status.TERMINATED,
    }


def test_paused_cannot_complete_without_resuming() -> None:
    # The code does not run while paused, so completion must come after a resume.
    state = InstanceState(ID, status=Status.PAUSED)
    with pytest.raises(InvalidTransition):
        state._transition_to(Status.COMPLETED)


def test_record_asking_for_an_invalid_transition_raises() -> None:
    rec = Recorder()
    state = fold([started(rec), rec(WorkflowCompleted, result=pj("1"))])
    with pytest.raises(InvalidTransition, match="completed -> paused"):
        state.apply(rec(WorkflowPaused))
    with pytest.raises(InvalidTransition, match="completed -> running"):
        state.apply(rec(WorkflowResumed))


def test_lifecycle_through_records() -> None:
    rec = Recorder()
    state = InstanceState(ID)
    state.apply(started(rec))
    assert state.status is Status.PENDING
    assert (state.workflow, state.version, state.input) == ("wf", "2", pj("1"))
    assert state.created_ms == T0 + 1
    state.apply(rec(StepAttemptStarted, key="a", attempt=1, max_attempts=3))
    assert state.status is Status.RUNNING
    state.apply(rec(WorkflowPaused))
    assert state.status is Status.PAUSED
    state.apply(rec(WorkflowResumed))
    assert state.status is Status.RUNNING
    state.apply(rec(WorkflowFailedRecord, error_type="ValueError", error_message="bad"))
    assert state.status is Status.FAILED
    assert (state.error_type, state.error_message) == ("ValueError", "bad")
    assert state.updated_ms == T0 + 5


def test_cancel_keeps_the_reason() -> None:
    rec = Recorder()
    state = fold([started(rec), rec(WorkflowCancelledRecord, reason="changed my mind")])
    assert state.status is Status.CANCELLED
    assert state.cancel_reason == "changed my mind"


# ---- entries --------------------------------------------------------------------------


def test_step_attempts_backoff_and_success() -> None:
    rec = Recorder()
    state = fold(
        [
            started(rec),
            rec(StepAttemptStarted, key="a", attempt=1, max_attempts=3),
            rec(
                StepFailedRecord,
                key="a",
                attempt=1,
                error_type="E",
                error_message="m",
                next_attempt_at_ms=T0 + 500,
            ),
        ]
    )
    entry = state.entries["a"]
    assert (entry.kind, entry.state, entry.seq) == (EntryKind.STEP, EntryState.BACKOFF, 2)
    assert entry.timer_id == timer_id(ID, "retry", "a", 1) == f"{ID}/retry/1/a"
    assert entry.fire_at_ms == T0 + 500
    assert state.pending_timers() == [entry]
    state.apply(rec(StepAttemptStarted, key="a", attempt=2, max_attempts=3))
    assert (entry.state, entry.attempt, entry.timer_id, entry.fire_at_ms) == (
        EntryState.RUNNING,
        2,
        None,
        None,
    )
    assert entry.seq == 2  # the key's first record, not its latest
    assert state.pending_timers() == [] and state.open_entries() == [entry]
    state.apply(rec(StepSucceeded, key="a", attempt=2, result=pj('"ok"')))
    assert entry.state is EntryState.SUCCEEDED and entry.result == pj('"ok"')
    assert entry.state.final and state.open_entries() == []


def test_final_step_failure() -> None:
    rec = Recorder()
    state = fold(
        [
            started(rec),
            rec(StepAttemptStarted, key="a", attempt=1, max_attempts=1),
            rec(StepFailedRecord, key="a", attempt=1, error_type="E", error_message="m"),
        ]
    )
    entry = state.entries["a"]
    assert entry.state is EntryState.FAILED
    assert (entry.error_type, entry.error_message, entry.timer_id) == ("E", "m", None)


def test_sleep_entry_and_its_timer() -> None:
    rec = Recorder()
    state = fold([started(rec), rec(SleepStarted, key="nap", wake_at_ms=T0 + 9000)])
    entry = state.entries["nap"]
    assert (entry.kind, entry.state) == (EntryKind.SLEEP, EntryState.SLEEPING)
    assert entry.timer_id == f"{ID}/sleep/2/nap" and entry.fire_at_ms == T0 + 9000
    assert state.status is Status.RUNNING
    state.apply(rec(SleepElapsed, key="nap"))
    assert entry.state is EntryState.ELAPSED and entry.timer_id is None
    assert state.pending_timers() == []


def test_wait_with_and_without_timeout() -> None:
    rec = Recorder()
    state = fold(
        [
            started(rec),
            rec(WaitStarted, key="w1", event_name="go"),
            rec(WaitStarted, key="w2", event_name="go", timeout_at_ms=T0 + 100),
        ]
    )
    assert state.entries["w1"].timer_id is None
    assert state.entries["w2"].timer_id == f"{ID}/wait/3/w2"
    assert state.pending_timers() == [state.entries["w2"]]
    state.apply(rec(WaitTimedOut, key="w2"))
    assert state.entries["w2"].state is EntryState.TIMED_OUT
    assert state.pending_timers() == []


def test_buffered_event_is_removed_by_the_wait_that_claims_it() -> None:
    rec = Recorder()
    state = fold(
        [
            started(rec),
            rec(EventBuffered, "ev-1", event_name="go", payload=pj("1")),
            rec(EventBuffered, "ev-2", event_name="go", payload=pj("2")),
            rec(WaitStarted, key="w", event_name="go"),
        ]
    )
    assert [(b.name, b.payload, b.command_id, b.seq) for b in state.buffered] == [
        ("go", pj("1"), "ev-1", 2),
        ("go", pj("2"), "ev-2", 3),
    ]
    assert all(b.time_ms > 0 for b in state.buffered)  # when each reached the instance
    state.apply(
        rec(WaitSatisfied, key="w", event_name="go", payload=pj("2"), event_command_id="ev-2")
    )
    assert [b.command_id for b in state.buffered] == ["ev-1"]
    assert state.entries["w"].state is EntryState.SATISFIED
    assert state.entries["w"].result == pj("2")


def test_value_recorded() -> None:
    rec = Recorder()
    state = fold([started(rec), rec(ValueRecorded, key="now#1", kind="now", value=pj("5"))])
    entry = state.entries["now#1"]
    assert (entry.kind, entry.state, entry.result) == (
        EntryKind.VALUE,
        EntryState.RECORDED,
        pj("5"),
    )
    assert state.status is Status.RUNNING


def test_command_ignored_changes_only_seq_and_time() -> None:
    rec = Recorder()
    state = fold([started(rec)])
    before = copy.deepcopy(state)
    state.apply(rec(CommandIgnored, "late", command_type="SendEvent", reason="finished"))
    assert state.seq == 2 and state.updated_ms == T0 + 2
    assert state.entries == before.entries and state.status is before.status
    assert list(state.recent_commands) == ["start", "late"]


def test_dirty_entries_name_what_changed() -> None:
    rec = Recorder()
    state = fold([started(rec), rec(StepAttemptStarted, key="a", attempt=1, max_attempts=1)])
    state.dirty_entries.clear()
    state.apply(rec(SleepStarted, key="b", wake_at_ms=T0))
    assert state.dirty_entries == {"b"}
    state.apply(rec(StepSucceeded, key="a", attempt=1, result=pj("1")))
    assert state.dirty_entries == {"a", "b"}


# ---- idempotence ----------------------------------------------------------------------


def _history() -> list[HistoryRecord]:
    rec = Recorder()
    return [
        started(rec),
        rec(StepAttemptStarted, "start", key="a", attempt=1, max_attempts=2),
        rec(
            StepFailedRecord,
            "step:a/1",
            key="a",
            attempt=1,
            error_type="E",
            error_message="m",
            next_attempt_at_ms=T0 + 50,
        ),
        rec(StepAttemptStarted, "fire:a", key="a", attempt=2, max_attempts=2),
        rec(StepSucceeded, "step:a/2", key="a", attempt=2, result=pj('"a"')),
        rec(EventBuffered, "ev-1", event_name="go", payload=pj("1")),
        rec(SleepStarted, "step:a/2", key="nap", wake_at_ms=T0 + 1000),
        rec(SleepElapsed, "fire:nap", key="nap"),
        rec(WaitStarted, "fire:nap", key="w", event_name="go"),
        rec(
            WaitSatisfied,
            "fire:nap",
            key="w",
            event_name="go",
            payload=pj("1"),
            event_command_id="ev-1",
        ),
        rec(ValueRecorded, "fire:nap", key="uuid#1", kind="uuid", value=pj('"u"')),
        rec(WorkflowCompleted, "fire:nap", result=pj("[1]")),
    ]


def _snapshot(state: InstanceState) -> tuple[bytes, dict[str, Entry]]:
    return meta_json(state), copy.deepcopy(state.entries)


def test_applying_a_history_twice_changes_nothing() -> None:
    history = _history()
    state = fold(history)
    once = _snapshot(state)
    for record in history:
        state.apply(record)
    assert _snapshot(state) == once


@given(st.data())
def test_any_record_at_or_below_seq_is_ignored(data: st.DataObject) -> None:
    history = _history()
    cut = data.draw(st.integers(1, len(history)))
    state = fold(history[:cut])
    before = _snapshot(state)
    replayed = data.draw(st.lists(st.sampled_from(history[:cut]), max_size=10))
    for record in replayed:
        state.apply(record)
    assert _snapshot(state) == before
    # ...and the rest of the history still applies on top of it.
    for record in history[cut:]:
        state.apply(record)
    assert _snapshot(state) == _snapshot(fold(history))


def test_a_different_record_with_an_old_seq_is_ignored() -> None:
    # A stale writer's record (e.g. an older epoch after a fence) never rewrites history.
    history = _history()
    state = fold(history[:5])
    before = _snapshot(state)
    state.apply(
        WorkflowFailedRecord(
            instance_id=ID, seq=5, command_id="x", error_type="E", error_message="m"
        )
    )
    assert _snapshot(state) == before and state.status is Status.RUNNING


def test_recent_commands_are_bounded_and_not_repeated() -> None:
    rec = Recorder()
    state = fold([started(rec)])
    for i in range(RECENT_COMMANDS + 10):
        command = f"ev-{i}"
        state.apply(rec(EventBuffered, command, event_name="e", payload=pj("1")))
        state.apply(rec(CommandIgnored, command, command_type="x", reason="y"))
    assert len(state.recent_commands) == RECENT_COMMANDS
    assert list(state.recent_commands)[-1] == f"ev-{RECENT_COMMANDS + 9}"
    assert len(set(state.recent_commands)) == RECENT_COMMANDS


# ---- stored form ----------------------------------------------------------------------


def _stored(state: InstanceState) -> InstanceState:
    """The state as the store keeps it (meta, entries, input, buffered events), read back."""
    entries = [(key, entry_json(entry)) for key, entry in state.entries.items()]
    stored_input = None if state.input is None else payload_bytes(state.input)
    buffered = [buffered_json(event) for event in state.buffered]
    return state_from_storage(state.instance_id, meta_json(state), entries, stored_input, buffered)


def _same(a: InstanceState, b: InstanceState) -> None:
    for name in (
        "instance_id",
        "workflow",
        "version",
        "status",
        "created_ms",
        "updated_ms",
        "seq",
        "input",
        "result",
        "error_type",
        "error_message",
        "cancel_reason",
        "buffered",
        "entries",
    ):
        assert getattr(a, name) == getattr(b, name), name
    assert list(a.recent_commands) == list(b.recent_commands)
    assert a.recent_commands.maxlen == b.recent_commands.maxlen


def test_storage_round_trip_at_every_point_of_a_history() -> None:
    history = _history()
    for cut in range(len(history) + 1):
        state = fold(history[:cut])
        restored = _stored(state)
        _same(restored, state)
        # A restored state goes on exactly like the original.
        for record in history[cut:]:
            state.apply(record)
            restored.apply(record)
        _same(restored, state)


@pytest.mark.parametrize("closing", ["SleepElapsed", "WaitSatisfied", "WaitTimedOut"])
def test_a_closed_timer_leaves_no_fire_time(closing: str) -> None:
    """A restored instance must be exactly the instance that was lost: the stored form
    keeps ``fire_at_ms`` only with a ``timer_id``, so live state must not keep it either."""
    rec = Recorder()
    records = [started(rec)]
    if closing == "SleepElapsed":
        records += [rec(SleepStarted, key="k", wake_at_ms=T0), rec(SleepElapsed, key="k")]
    else:
        records.append(rec(WaitStarted, key="k", event_name="go", timeout_at_ms=T0))
        if closing == "WaitSatisfied":
            records.append(rec(WaitSatisfied, key="k", event_name="go", payload=pj("1")))
        else:
            records.append(rec(WaitTimedOut, key="k"))
    state = fold(records)
    assert state.entries["k"].timer_id is None
    assert _stored(state).entries == state.entries, (
        f"live {state.entries['k']} != restored {_stored(state).entries['k']}"
    )


def test_storage_keeps_binary_payloads_and_failures() -> None:
    rec = Recorder()
    odd = Payload("application/x-encrypted", bytes(range(256)))
    state = fold(
        [
            rec(WorkflowStarted, workflow="wf", version="1", input=odd),
            rec(EventBuffered, "ev", event_name="e", payload=odd),
            rec(WorkflowFailedRecord, error_type="Boom", error_message="ünïcode\n\x00"),
        ]
    )
    restored = _stored(state)
    _same(restored, state)
    assert restored.input == odd and restored.buffered[0].payload == odd


_payloads = st.builds(Payload, st.sampled_from(["application/json", "x/y"]), st.binary())
_entries = st.builds(
    Entry,
    key=st.text(min_size=1),
    kind=st.sampled_from(EntryKind),
    state=st.sampled_from(EntryState),
    seq=st.integers(1, 2**62),
    attempt=st.integers(0, 100),
    max_attempts=st.integers(1, 100),
    result=st.none() | _payloads,
    error_type=st.text(),
    error_message=st.text(),
    timer_id=st.none() | st.text(),
    fire_at_ms=st.none() | st.integers(0, 2**62),
    event_name=st.none() | st.text(),
    winner=st.none() | st.text(),
    losers=st.none() | st.lists(st.text(), max_size=3),
    marks=st.none() | st.dictionaries(st.integers(0, 2**31), st.integers(1, 2**62), max_size=3),
    child_id=st.none() | st.text(),
    names=st.none() | st.lists(st.text(), max_size=3),
    messages=st.none()
    | st.lists(st.tuples(st.text(), st.text(), _payloads, st.integers(0, 2**62)), max_size=2),
)


@given(_entries)
def test_entry_json_round_trip(entry: Entry) -> None:
    if not entry.attempt:
        entry.max_attempts = 0  # not stored without an attempt
    if not entry.error_type:
        entry.error_message = ""  # the message is stored with its type
    if entry.timer_id is None:
        entry.fire_at_ms = None  # the fire time is stored with its timer
    if entry.winner is None:
        entry.losers = None  # a race's losers are stored with its winner
    restored = entry_from_json(entry.key, json.loads(entry_json(entry)))
    assert restored == entry


def test_meta_is_small_and_does_not_grow_with_entries() -> None:
    rec = Recorder()
    records: list[HistoryRecord] = [started(rec)]
    state = fold(records)
    small = len(meta_json(state))
    for i in range(200):
        state.apply(rec(StepAttemptStarted, f"c{i}", key=f"s{i}", attempt=1, max_attempts=1))
        state.apply(rec(StepSucceeded, f"c{i}", key=f"s{i}", attempt=1, result=pj("1")))
    # recent_commands is bounded, entries are stored apart: meta stays O(1).
    assert len(meta_json(state)) < small + RECENT_COMMANDS * 8 + 200


def test_the_meta_leaves_the_input_out_whatever_its_size() -> None:
    """Each transition rewrites the meta: an input inside it would be written again at
    every step (100 KB inputs made steps 7 times slower). It has a key of its own."""
    metas = []
    for size in (10, 100_000):
        rec = Recorder()
        big = pj(json.dumps("x" * size))
        state = fold([rec(WorkflowStarted, "start", workflow="wf", version="2", input=big)])
        assert state.new_input  # to be stored once, with the start
        state.apply(rec(StepAttemptStarted, "c1", key="s", attempt=1, max_attempts=1))
        metas.append(meta_json(state))
    assert len(metas[0]) == len(metas[1]) < 1_000


def test_a_meta_that_holds_its_input_is_read_and_its_input_moved_out() -> None:
    """State written before the input had a key of its own: the input is read from the
    meta, and the next write stores it under its key."""
    rec = Recorder()
    state = fold([started(rec), rec(StepAttemptStarted, "c1", key="s", attempt=1, max_attempts=1)])
    older = json.loads(meta_json(state))
    older["i"] = [state.input.content_type, "MQ=="]  # "1", base64, as the older layout had it
    restored = state_from_storage(ID, json.dumps(older).encode(), [])
    assert restored.input == pj("1")
    assert restored.new_input
    assert b'"i"' not in meta_json(restored)
    # The current layout: the meta has none, the caller reads the input key.
    current = state_from_storage(ID, meta_json(state), [], payload_bytes(pj("1")))
    assert current.input == pj("1") and not current.new_input
    assert state_from_storage(ID, meta_json(state), []).input is None  # not read


def test_buffered_events_are_stored_one_key_each_as_they_come_and_go() -> None:
    """Events wait in the buffer until the code takes them: in the meta, every
    transition would rewrite every waiting payload (1,000 events of 2 KB took 3.4 times
    as long as 500). The meta counts them; each has a key, put once and deleted once."""
    rec = Recorder()
    state = fold([started(rec)])
    big = pj(json.dumps("x" * 2_000))
    for i in range(50):
        state.apply(rec(EventBuffered, f"ev-{i}", event_name="other", payload=big))
    assert [e.seq for e in state.new_buffered] == list(range(2, 52))
    meta = meta_json(state)
    assert len(meta) < 3_000 and json.loads(meta)["bn"] == 50
    state.new_buffered.clear()  # written
    state.apply(rec(WaitStarted, "c1", key="w", event_name="other", timeout_at_ms=None))
    state.apply(
        rec(
            WaitSatisfied, "ev-3", key="w", event_name="other", payload=big, event_command_id="ev-3"
        )
    )
    assert state.taken_buffered == [5] and len(state.buffered) == 49
    # Read for a status only (no buffered keys read): the count comes from the meta.
    status_only = state_from_storage(ID, meta_json(state), [])
    assert status_only.buffered == [] and status_only.unread_buffered == 49
    assert InstanceStatus.of(status_only).buffered_events == 49
    assert json.loads(meta_json(status_only))["bn"] == 49  # written back, still counted


def test_taking_buffered_events_keeps_the_others_in_order() -> None:
    """Messages taken from the middle of the buffer leave the rest as they came, and
    each taken one is marked for deletion once."""
    rec = Recorder()
    state = fold([started(rec)])
    for i, name in enumerate("abab a".replace(" ", "")):
        state.apply(rec(EventBuffered, f"ev-{i}", event_name=name, payload=pj(str(i))))
    state.apply(rec(MessageWaitStarted, "c1", key="m", names=["a"], max=2))
    state.apply(
        rec(
            MessagesReceived,
            "c1",
            key="m",
            ids=["ev-0", "ev-2"],
            names=["a", "a"],
            content_types=["application/json"] * 2,
            data=[b"0", b"2"],
            sent_ms=[T0, T0],
        )
    )
    assert [b.command_id for b in state.buffered] == ["ev-1", "ev-3", "ev-4"]
    assert state.taken_buffered == [2, 4]  # the seqs of ev-0 and ev-2
    assert state.entries["m"].state is EntryState.SATISFIED


def test_an_event_finds_the_waits_for_its_name_also_after_a_reload() -> None:
    rec = Recorder()
    state = fold(
        [
            started(rec),
            rec(WaitStarted, "c1", key="w1", event_name="a", timeout_at_ms=None),
            rec(MessageWaitStarted, "c2", key="m1", names=["a", "b"], max=1),
            rec(WaitStarted, "c3", key="w2", event_name="c", timeout_at_ms=None),
        ]
    )

    def keys(s: InstanceState, name: str) -> set[str]:
        return {e.key for e in s.waiting_for(name)}

    assert (keys(state, "a"), keys(state, "b"), keys(state, "zz")) == ({"w1", "m1"}, {"m1"}, set())
    state.apply(
        rec(WaitSatisfied, "ev", key="w1", event_name="a", payload=pj("1"), event_command_id="ev")
    )
    assert keys(state, "a") == {"m1"}
    restored = _stored(state)
    assert (keys(restored, "a"), keys(restored, "b"), keys(restored, "c")) == (
        {"m1"},
        {"m1"},
        {"w2"},
    )


def test_a_timer_fire_finds_its_entry_by_the_key_its_id_names() -> None:
    """Ids are ``<instance>/<purpose>/<n>/<key>``; instance ids and keys may hold "/"."""
    state = InstanceState("parent/child-1")
    state.apply(
        SleepStarted(
            instance_id="parent/child-1",
            seq=1,
            time_ms=T0,
            command_id="c",
            key="s/nap",
            wake_at_ms=T0,
        )
    )
    entry = state.entries["s/nap"]
    assert entry.timer_id == "parent/child-1/sleep/1/s/nap"
    assert state.pending_timer(entry.timer_id) is entry
    assert state.pending_timer("parent/child-1/sleep/7/s/nap") is None  # an older schedule
    assert state.pending_timer("other/sleep/1/s/nap") is None
    state.apply(
        SleepElapsed(instance_id="parent/child-1", seq=2, time_ms=T0, command_id="t", key="s/nap")
    )
    assert state.pending_timer("parent/child-1/sleep/1/s/nap") is None  # fired already


def test_a_meta_that_holds_buffered_events_is_read_and_they_move_out() -> None:
    rec = Recorder()
    state = fold([started(rec), rec(EventBuffered, "ev-1", event_name="e", payload=pj("7"))])
    older = json.loads(meta_json(state))
    del older["bn"]
    older["b"] = [["e", ["application/json", "Nw=="], "ev-1", 2]]  # no time: older still
    restored = state_from_storage(ID, json.dumps(older).encode(), [])
    assert restored.buffered == [BufferedEvent("e", pj("7"), "ev-1", 2, 0)]
    assert restored.new_buffered == restored.buffered  # stored under their keys next
    assert "b" not in json.loads(meta_json(restored))


def test_state_of_the_older_layout_is_moved_to_its_keys_at_the_next_write() -> None:
    """A data directory written before inputs and buffered events had keys of their own:
    the first write after reading such a meta stores them under their keys, and the meta
    it writes holds neither; read back the current way, nothing is lost."""
    from stepstream.consumers import state_keys
    from stepstream.consumers.instance_store import write_state
    from stepstream.engine.seams import CommitBatch

    rec = Recorder()
    state = fold([started(rec), rec(EventBuffered, "ev-1", event_name="e", payload=pj("7"))])
    older = json.loads(meta_json(state))
    del older["bn"]
    older["i"] = ["application/json", "MQ=="]
    older["b"] = [["e", ["application/json", "Nw=="], "ev-1", 2, T0 + 2]]
    restored = state_from_storage(ID, json.dumps(older).encode(), [])
    batch = CommitBatch()
    write_state(restored, batch)
    meta = json.loads(batch.puts[state_keys.meta(ID)])
    assert "i" not in meta and "b" not in meta and meta["bn"] == 1
    stored_input = batch.puts[state_keys.input_key(ID)]
    stored_event = batch.puts[state_keys.buffered(ID, 2)]
    current = state_from_storage(
        ID, batch.puts[state_keys.meta(ID)], [], stored_input, [stored_event]
    )
    _same(current, state)
    again = CommitBatch()
    write_state(current, again)  # moved once: the next write leaves them be
    assert set(again.puts) >= {state_keys.meta(ID)}
    assert state_keys.input_key(ID) not in again.puts
    assert state_keys.buffered(ID, 2) not in again.puts


def test_the_settlement_of_a_recorded_ignore_is_rebuilt_from_its_record() -> None:
    """What a publisher is told about a command an earlier owner recorded as ignored."""
    from stepstream.engine.wire.settle import error_for, recorded_reason

    assert recorded_reason("SendEvent", "instance is completed") == "instance finished: completed"
    assert recorded_reason("ResumeWorkflow", "instance is cancelled, not paused") == (
        "instance finished: cancelled"
    )
    reason = recorded_reason("ResumeWorkflow", "instance is running, not paused")
    assert reason is not None
    assert "is running, not paused" in str(error_for(reason, "i-1", "resume"))
    assert recorded_reason("PauseWorkflow", "instance is paused") is None
    assert recorded_reason("StartWorkflow", "instance already exists (status running)") is None


# ---- scopes: loop iterations and race branches found without a walk --------------------

_SCOPED_KEYS = st.sampled_from(
    [
        *("count/1/inc", "count/1.t", "count/10/inc", "count/2/inc", "count/2/r/a/s"),
        *("count/2/r/b/s", "count/3/inc", "count/30/x", "other/1/inc", "plain", "count"),
        *("count/1/inc#2", "r/a/w"),
    ]
)
_SCOPE_PREFIXES = ["count/1/", "count/1.", "count/2/r/b/", "count/", "r/a/", "r/", "count/3", ""]


def _brute_under(state: InstanceState, prefix: str) -> list[Entry]:
    found = [e for e in state.entries.values() if e.key.startswith(prefix)]
    return sorted(found, key=lambda e: e.seq)


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("step"), _SCOPED_KEYS),
            st.tuples(st.just("race"), st.sampled_from(_SCOPE_PREFIXES[:6])),
            st.tuples(st.just("loop"), st.integers(min_value=1, max_value=4)),
        ),
        max_size=40,
    ),
    st.booleans(),
)
def test_entries_under_a_scope_match_a_walk_of_all_entries(ops: list[Any], reload: bool) -> None:
    """The sorted key index answers as a walk would, through new entries, abandoned
    races and pruned loop iterations, whether built before them or after a reload."""
    rec = Recorder()
    state = fold([started(rec)])
    iteration = 1
    for n, (op, arg) in enumerate(ops):
        if op == "step":
            state.apply(rec(StepAttemptStarted, key=arg, attempt=1, max_attempts=3))
        elif op == "race":
            state.apply(rec(RaceDecided, key=f"race{n}", winner="w", losers=[arg]))
        else:
            iteration += 1
            state.apply(
                rec(LoopAdvanced, key="count", iteration=iteration, state=pj("0"), keep=arg)
            )
        if reload and n % 7 == 3:
            state = _stored(state)
        for prefix in _SCOPE_PREFIXES:
            assert state.under([prefix]) == _brute_under(state, prefix)
        order = state.key_order.keys
        assert order is None or order == sorted(state.entries)
    both = state.under(["count/1/", "count/"])  # overlapping scopes: each entry once
    assert both == _brute_under(state, "count/")


def test_a_loop_prunes_its_old_iterations_and_races_abandon_only_their_losers() -> None:
    rec = Recorder()
    state = fold([started(rec)])
    for key in ["before", "count/0/inc", "count/0/r/a/s", "count/0/r/b/s", "count/00/inc"]:
        state.apply(rec(StepAttemptStarted, key=key, attempt=1, max_attempts=3))
    state.apply(rec(RaceDecided, key="count/0/r", winner="a", losers=["count/0/r/b/"]))
    assert state.entries["count/0/r/b/s"].state is EntryState.ABANDONED
    assert state.entries["count/0/r/a/s"].state is EntryState.RUNNING
    state.apply(rec(LoopAdvanced, key="count", iteration=1, state=pj("1"), keep=1))
    state.apply(rec(StepAttemptStarted, key="count/1/inc", attempt=1, max_attempts=3))
    state.apply(rec(LoopAdvanced, key="count", iteration=2, state=pj("2"), keep=1))
    # Iteration 0 is gone, not the step of a scope that only begins like it.
    assert sorted(state.entries) == ["before", "count", "count/00/inc", "count/1/inc"]
    assert state.deleted_entries == {"count/0/inc", "count/0/r", "count/0/r/a/s", "count/0/r/b/s"}


def test_the_active_index_is_put_once_per_state_and_left_when_it_finishes() -> None:
    """Startup recovery and the finished check read the active index: a state puts its
    key with its first write (again after being read back), not at every transition."""
    from stepstream.consumers import state_keys
    from stepstream.consumers.instance_store import write_state
    from stepstream.engine.seams import CommitBatch

    active = state_keys.active(ID)

    def written(state: InstanceState) -> CommitBatch:
        batch = CommitBatch()
        write_state(state, batch)
        return batch

    rec = Recorder()
    state = fold([started(rec)])
    assert active in written(state).puts
    state.apply(rec(StepAttemptStarted, key="a", attempt=1, max_attempts=1))
    assert active not in written(state).puts
    reloaded = _stored(state)
    assert active in written(reloaded).puts
    reloaded.apply(rec(WorkflowCompleted, result=pj("1")))
    done = written(reloaded)
    assert active in done.deletes and active not in done.puts
    assert state_keys.finished(reloaded.finished_ms, ID) in done.puts
