"""The index by created time lists exactly what reading every meta lists: for random
instances (many started in the same ms, several id prefixes, statuses, attributes, new
runs that move an instance to a later start, instances forgotten), every query shape
(filters, time ranges, page sizes, both orders) gives the same pages, cursor by cursor,
from the index and from the metas; a page the index cannot fill within its budget is
left to the metas rather than answered differently; and a restore that folds history
keeps the index as the processor does."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stepstream.consumers import state_keys as keys
from stepstream.consumers.created_listing import (
    page_by_created,
    page_from_index,
    page_from_metas,
)
from stepstream.consumers.instance_store import forget_instance, load_state, write_state
from stepstream.consumers.kafka.db import PartitionDB
from stepstream.consumers.restore import Restorer
from stepstream.engine.reads.listing import InstancePage, ListQuery
from stepstream.engine.reads.views import created_iso
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.replay.status import Status
from stepstream.engine.seams import CommitBatch
from stepstream.engine.wire.records import (
    AttributesSet,
    HistoryRecord,
    InstanceForgotten,
    Payload,
    StepAttemptStarted,
    WorkflowCompleted,
    WorkflowFailedRecord,
    WorkflowRestarted,
    WorkflowStarted,
)
from stepstream.engine.wire.serde import default_serde

T0 = 1_700_000_000_000
PREFIXES = ("a-", "ab-", "b-", "~q/")
INPUT = Payload("application/json", b"null")


def _commit(db: PartitionDB, batch: CommitBatch) -> None:
    db.write(puts=list(batch.puts.items()), deletes=list(batch.deletes))


class _Instances:
    """Instances folded from records and stored as a commit stores them."""

    def __init__(self, db: PartitionDB, rng: random.Random) -> None:
        self.db = db
        self.rng = rng
        self.seq: dict[str, itertools.count[int]] = {}

    def _apply(self, state: InstanceState, cls: type[HistoryRecord], ms: int, **attrs: Any) -> None:
        seq = self.seq.setdefault(state.instance_id, itertools.count(state.seq + 1))
        state.apply(
            cls(instance_id=state.instance_id, seq=next(seq), time_ms=ms, command_id="c", **attrs)
        )

    def run(self, state: InstanceState, ms: int) -> None:
        """A run started at ``ms``, left pending, running, completed or failed, with
        attributes set or not."""
        rng = self.rng
        workflow = rng.choice(["wf", "other"])
        self._apply(state, WorkflowStarted, ms, workflow=workflow, version="1", input=INPUT)
        if rng.random() < 0.7:
            self._apply(state, StepAttemptStarted, ms + 5, key="s", attempt=1, max_attempts=1)
        if rng.random() < 0.6:
            attributes = {"tier": rng.choice(["gold", "basic"]), "n": rng.randrange(3)}
            self._apply(state, AttributesSet, ms + 6, key="a", attributes=attributes)
        end = rng.random()
        if end < 0.3:
            self._apply(state, WorkflowCompleted, ms + 9, result=INPUT)
        elif end < 0.5:
            self._apply(state, WorkflowFailedRecord, ms + 9, error_type="E", error_message="m")

    def new(self, instance_id: str, ms: int) -> None:
        state = InstanceState(instance_id)
        self.run(state, ms)
        self.store(state)

    def restart(self, instance_id: str, ms: int) -> None:
        """A new run of a stored instance (as a start with restart_if_failed makes)."""
        state = load_state(self.db, instance_id)
        assert state is not None
        if state.status is Status.COMPLETED:
            return  # not restartable
        if not state.status.finished:
            self._apply(state, WorkflowFailedRecord, ms - 1, error_type="E", error_message="m")
        self._apply(state, WorkflowRestarted, ms, run=state.run + 1, previous_status="failed")
        self.run(state, ms)
        self.store(state)

    def store(self, state: InstanceState) -> None:
        batch = CommitBatch()
        write_state(state, batch)
        _commit(self.db, batch)

    def forget(self, instance_id: str) -> None:
        batch = CommitBatch()
        forget_instance(self.db, instance_id, batch)
        _commit(self.db, batch)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[PartitionDB]:
    opened = PartitionDB.open(str(tmp_path / "p0"), 0, 1)
    yield opened
    opened.close()


def _fill(db: PartitionDB, seed: int) -> list[int]:
    """300 instances over 40 distinct ms (so many tie), 40 of them started again later,
    30 forgotten; returns the ms used."""
    rng = random.Random(seed)
    made = _Instances(db, rng)
    times = sorted({T0 + rng.randrange(400) * 7 for _ in range(40)})
    ids = [f"{rng.choice(PREFIXES)}{n:03d}" for n in range(300)]
    for instance_id in ids:
        made.new(instance_id, rng.choice(times))
    for instance_id in rng.sample(ids, 40):
        made.restart(instance_id, rng.choice(times) + 3000)
    for instance_id in rng.sample(ids, 30):
        made.forget(instance_id)
    db.write(puts=[(keys.STARTED_INDEXED, b"")])
    return times


def _queries(rng: random.Random, times: list[int]) -> list[ListQuery]:
    moments = [*times, times[0] - 1, times[-1] + 4000, times[len(times) // 2] + 3000]
    out = []
    for _ in range(120):
        since, until = (
            created_iso(rng.choice(moments)) if rng.random() < 0.3 else None for _ in range(2)
        )
        out.append(
            ListQuery(
                status=rng.choice([None, None, "pending", "running", "completed", "failed"]),
                workflow=rng.choice([None, None, "wf"]),
                prefix=rng.choice(["", "", "a", "ab-", "b-", "~", "zz"]),
                order=rng.choice(["newest", "oldest"]),
                limit=rng.choice([1, 3, 7, 50]),
                since=since,
                until=until,
                where=rng.choice([(), (), (("tier", "gold"),), (("n", 1),)]),
            )
        )
    return out


def _pages(
    read: Callable[[ListQuery], InstancePage | None], query: ListQuery
) -> list[InstancePage]:
    """Every page of ``query``, each from the cursor of the one before."""
    pages: list[InstancePage] = []
    while True:
        page = read(query)
        assert page is not None, query
        pages.append(page)
        if page.next is None or len(pages) > 400:
            return pages
        query = query.resumed(page.next, query.limit)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_index_lists_what_the_metas_list(db: PartitionDB, seed: int) -> None:
    times = _fill(db, seed)
    rng = random.Random(seed * 101)
    for query in _queries(rng, times):
        expected = _pages(lambda q: page_from_metas(db, q), query)
        got = _pages(lambda q: page_from_index(db, q, 10**9), query)
        assert got == expected, query
        # With a budget too small for the page, the index gives it up, never answers
        # otherwise; the listing then reads the metas.
        for page_query, page in zip(
            [query, *(query.resumed(p.next, query.limit) for p in expected[:-1])],
            expected,
            strict=True,
        ):
            small = page_from_index(db, page_query, 5)
            assert small is None or small == page, page_query
            assert page_by_created(db, page_query) == page, page_query
    listed = _pages(lambda q: page_from_index(db, q, 10**9), ListQuery(order="newest", limit=500))
    assert [i.instance_id for i in listed[0].instances] == [
        i for i, _ in sorted(_metas(db).items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
    ]


def _metas(db: PartitionDB) -> dict[str, str]:
    """Instance id -> created time, read off every meta."""
    found = {}
    for key, _ in db.scan(keys.META):
        instance_id = keys.split_meta(key)
        state = load_state(db, instance_id, entries=False)
        assert state is not None
        found[instance_id] = created_iso(state.created_ms)
    return found


def test_every_instance_has_one_key_in_the_index_at_its_start(db: PartitionDB) -> None:
    """New runs moved their instance's key and forgotten instances took theirs along."""
    _fill(db, 4)
    indexed = sorted(keys.split_started(key) for key, _ in db.scan(keys.STARTED))
    stored = []
    for key, _ in db.scan(keys.META):
        state = load_state(db, keys.split_meta(key), entries=False)
        assert state is not None
        stored.append((state.created_ms, state.instance_id))
    assert indexed == sorted(stored)
    assert len(stored) == 270


def test_the_reverse_scan_keeps_to_its_prefix_and_bound(db: PartitionDB) -> None:
    db.write(puts=[(k, b"") for k in (b"r", b"s", b"s\x00\x01", b"s\x00\x05", b"s\x01", b"t")])
    assert [k for k, _ in db.scan_reverse(b"s\x00")] == [b"s\x00\x05", b"s\x00\x01"]
    assert [k for k, _ in db.scan_reverse(b"s\x00", b"s\x00\x05")] == [b"s\x00\x01"]
    assert [k for k, _ in db.scan_reverse(b"s\x00", b"s\x00\x01")] == []
    assert [k for k, _ in db.scan_reverse(b"s\x00", b"z")] == [b"s\x00\x05", b"s\x00\x01"]
    assert [k for k, _ in db.scan_reverse(b"u")] == []
    assert [k for k, _ in db.scan_reverse(b"", b"s\x00")] == [b"s", b"r"]


def test_a_restore_keeps_the_index_of_what_it_folds(db: PartitionDB) -> None:
    """Folding history (a worker without state, or behind the topic) moves an instance's
    key to its new run and drops a forgotten one's, over state stored by an earlier
    fold as over its own."""
    serde = default_serde()

    def fold(*records: HistoryRecord) -> None:
        restorer = Restorer(db, serde)
        for record in records:
            restorer.apply(serde.encode(record))
        _commit(db, restorer.batch())

    def rec(
        cls: type[HistoryRecord], instance_id: str, seq: int, ms: int, **attrs: Any
    ) -> HistoryRecord:
        return cls(instance_id=instance_id, seq=seq, time_ms=ms, command_id=f"c{seq}", **attrs)

    def started(instance_id: str, seq: int, ms: int) -> HistoryRecord:
        return rec(WorkflowStarted, instance_id, seq, ms, workflow="wf", version="1", input=INPUT)

    failed = {"error_type": "E", "error_message": "m"}
    fold(
        started("x", 1, T0),
        rec(WorkflowFailedRecord, "x", 2, T0 + 1, **failed),
        started("y", 1, T0 + 2),
        rec(WorkflowCompleted, "y", 2, T0 + 3, result=INPUT),
        started("z", 1, T0 + 4),
    )
    assert _index(db) == [(T0, "x"), (T0 + 2, "y"), (T0 + 4, "z")]
    fold(
        rec(WorkflowRestarted, "x", 3, T0 + 50, run=2, previous_status="failed"),
        started("x", 4, T0 + 50),
        rec(InstanceForgotten, "y", 3, T0 + 60, finished_ms=T0 + 3),
        started("w", 1, T0 + 70),
        rec(WorkflowFailedRecord, "w", 2, T0 + 71, **failed),
        rec(WorkflowRestarted, "w", 3, T0 + 80, run=2, previous_status="failed"),
        started("w", 4, T0 + 80),
    )
    assert _index(db) == [(T0 + 4, "z"), (T0 + 50, "x"), (T0 + 80, "w")]


def _index(db: PartitionDB) -> list[tuple[int, str]]:
    return [keys.split_started(key) for key, _ in db.scan(keys.STARTED)]
