"""What a Kafka snapshot copies of a partition's state: every instance's keys as they were
when the copy began, whatever is committed while it is read (the snapshot's offsets say
which point of the history that is), with the active or finished key of each."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from stepstream.consumers import state_keys
from stepstream.consumers.instance_store import write_state
from stepstream.consumers.kafka.db import PartitionDB
from stepstream.consumers.kafka.snapshots import CHUNK_BYTES, _StateView
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.seams import CommitBatch
from stepstream.engine.wire.records import (
    EventBuffered,
    HistoryRecord,
    Payload,
    StepAttemptStarted,
    StepSucceeded,
    WorkflowCompleted,
    WorkflowStarted,
)

T0 = 1_700_000_000_000


def _payload(text: str) -> Payload:
    return Payload("application/json", text.encode())


def _commit(db: PartitionDB, batch: CommitBatch) -> None:
    db.write(puts=list(batch.puts.items()), deletes=list(batch.deletes))


def _instance(db: PartitionDB, instance_id: str, *, steps: int, finish: bool) -> InstanceState:
    """An instance's records folded and stored, as a commit stores them."""
    seq = itertools.count(1)

    def rec(cls: type[HistoryRecord], **attrs: object) -> HistoryRecord:
        n = next(seq)
        return cls(instance_id=instance_id, seq=n, time_ms=T0 + n, command_id="c", **attrs)

    state = InstanceState(instance_id)
    batch = CommitBatch()
    records = [rec(WorkflowStarted, workflow="wf", version="1", input=_payload('"in"'))]
    for i in range(steps):
        records.append(rec(StepAttemptStarted, key=f"s{i}", attempt=1, max_attempts=3))
        records.append(rec(StepSucceeded, key=f"s{i}", attempt=1, result=_payload(str(i))))
    records.append(rec(EventBuffered, event_name="later", payload=_payload("1")))
    if finish:
        records.append(rec(WorkflowCompleted, result=_payload('"done"')))
    for record in records:
        state.apply(record)
        batch.put(state_keys.history(instance_id, record.seq), b"record %d" % record.seq)
    write_state(state, batch)
    _commit(db, batch)
    return state


def _everything(db: PartitionDB) -> dict[bytes, bytes]:
    return dict(db.scan(b""))


def _copied(view: _StateView) -> dict[bytes, bytes]:
    async def read() -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        async for names, values in view.chunks():
            out.update(zip(names, values, strict=True))
        return out

    return asyncio.run(read())


def test_a_snapshot_copies_the_state_as_it_was_when_it_began(tmp_path: Path) -> None:
    db = PartitionDB.open(str(tmp_path / "p0"), 0, 1)
    try:
        running = _instance(db, "a/1", steps=3, finish=False)
        finished = _instance(db, "b", steps=2, finish=True)
        _instance(db, "c", steps=1, finish=False)
        before = _everything(db)
        view = _StateView(db)
        # Committed while the copy is read: none of it is in the copy.
        _instance(db, "d", steps=1, finish=False)
        forget = CommitBatch()
        for prefix in state_keys.instance_prefixes("c"):
            for key, _ in db.scan(prefix):
                forget.delete(key)
        forget.delete(state_keys.meta("c"))
        forget.delete(state_keys.active("c"))
        _commit(db, forget)
        try:
            copied = _copied(view)
        finally:
            view.close()
        timer_index = (state_keys.TIMER, state_keys.TIMER_BY_ID)
        # The index by created time comes whole, with its mark: a restore lists as here.
        assert copied == {
            **{k: v for k, v in before.items() if not k.startswith(timer_index)},
            state_keys.STARTED_INDEXED: b"",
        }
        assert state_keys.started(running.created_ms, "a/1") in copied
        assert state_keys.active(running.instance_id) in copied
        assert state_keys.active(finished.instance_id) not in copied
        assert state_keys.finished(finished.finished_ms, "b") in copied
        assert state_keys.input_key("c") in copied and state_keys.meta("d") not in copied
    finally:
        db.close()


def test_a_snapshot_of_many_instances_comes_in_small_chunks(tmp_path: Path) -> None:
    db = PartitionDB.open(str(tmp_path / "p0"), 0, 1)
    try:
        for i in range(300):
            _instance(db, f"i{i:03}", steps=5, finish=i % 3 == 0)
        view = _StateView(db)

        async def chunks() -> list[tuple[list[bytes], list[bytes]]]:
            return [chunk async for chunk in view.chunks()]

        try:
            read = asyncio.run(chunks())
        finally:
            view.close()
        sizes = [sum(len(k) + len(v) + 8 for k, v in zip(*chunk, strict=True)) for chunk in read]
        assert len(sizes) > 1 and max(sizes) <= CHUNK_BYTES, sizes
        copied = [key for names, _ in read for key in names]
        assert len(copied) == len(set(copied)) == len(_everything(db)) + 1  # the index's mark
        assert sum(key.startswith(state_keys.STARTED) for key in copied) == 300
        assert sum(key.startswith(state_keys.FINISHED) for key in copied) == 100
        assert sum(key.startswith(state_keys.ACTIVE) for key in copied) == 200
    finally:
        db.close()
