"""An engine bug on an instance's input (not user code) never leaves the instance stuck.

Whatever input hit the bug (a command, a lone step outcome, a lone timer fire), the
instance is reloaded from its committed state and driven on: an attempt whose outcome
was lost is recorded as lost and retried, a timer fire is scheduled again. A step body
that raises ``CancelledError`` of its own reports its attempt like any failure.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from stepstream.engine.replay.inputs import HANDLERS
from stepstream.engine.replay.runtime import InstanceRuntime, StepOutcome
from stepstream.engine.wire.records import TimerFired
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests.conftest import test_registry as workflows_of_tests


def _bug_once(monkeypatch: pytest.MonkeyPatch, kind: type, hits: list[Any]) -> None:
    """An engine bug, injected: the first input of ``kind`` the runtime handles raises."""
    real = HANDLERS[kind]

    def buggy(rt: InstanceRuntime, msg: Any) -> None:
        if not hits:
            hits.append(msg)
            raise RuntimeError("a bug in the engine")
        real(rt, msg)

    monkeypatch.setitem(HANDLERS, kind, buggy)


async def _history(client: Client, instance: str) -> list[tuple[str, dict[str, Any]]]:
    return [(h.type, h.attributes) for h in await client.history(instance)]


async def test_a_lone_step_outcome_that_hits_a_bug_is_recorded_as_lost_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hits: list[Any] = []
    _bug_once(monkeypatch, StepOutcome, hits)
    engine = await open_embedded(
        workflows_of_tests(), EmbeddedConfig(data_dir=str(tmp_path / "d"), partitions=1)
    )
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("arith", 4, instance_id="lone-outcome")
        try:
            assert await client.result("lone-outcome", timeout=10) == {"total": 5, "doubled": 10}
        except Exception:
            print(*await _history(client, "lone-outcome"), sep="\n")
            raise
        assert len(hits) == 1 and isinstance(hits[0], StepOutcome)
        failed = [a for t, a in await _history(client, "lone-outcome") if t == "StepFailed"]
        assert [(a["key"], a["attempt"], a["error_type"]) for a in failed] == [
            (hits[0].key, 1, "AttemptLost")
        ]


async def test_a_lone_timer_fire_that_hits_a_bug_fires_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hits: list[Any] = []
    _bug_once(monkeypatch, TimerFired, hits)
    engine = await open_embedded(
        workflows_of_tests(), EmbeddedConfig(data_dir=str(tmp_path / "d"), partitions=1)
    )
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("sleeper", 0.2, instance_id="lone-fire")
        result = await client.result("lone-fire", timeout=15)
        assert len(hits) == 1 and isinstance(hits[0], TimerFired)
        assert result["slept"] >= 0.2
        types = [t for t, _ in await _history(client, "lone-fire")]
        assert types.count("SleepElapsed") == 1
        assert engine.db.log.end_offset("dead-letters", 0) == 0  # nothing dead-lettered


async def test_a_step_body_raising_cancelled_error_reports_its_attempt(client: Client) -> None:
    await client.start("cancelled-step", None, instance_id="cancelled-body")
    assert await client.result("cancelled-body", timeout=20) == "second attempt"
    failed = [
        h.attributes for h in await client.history("cancelled-body") if h.type == "StepFailed"
    ]
    assert [(a["attempt"], a["error_type"]) for a in failed] == [(1, "CancelledError")]


async def test_the_list_shows_what_each_running_instance_waits_on(client: Client) -> None:
    await client.start("sleeper", 3600, instance_id="list-sleeper")
    await client.start("waiter", None, instance_id="list-waiter")
    await client.start("arith", 1, instance_id="list-done")
    await client.result("list-done", timeout=20)
    for _ in range(200):
        listed = {s.instance_id: s for s in await client.list()}
        if all(listed.get(i) and listed[i].waits for i in ("list-sleeper", "list-waiter")):
            break
        await asyncio.sleep(0.02)
    assert [(w.kind, w.key) for w in listed["list-sleeper"].waits] == [("sleep", "nap")]
    assert listed["list-sleeper"].waits == (await client.status("list-sleeper")).waits
    assert [w.kind for w in listed["list-waiter"].waits] == ["wait"]
    assert listed["list-done"].waits == []


async def test_an_instance_whose_version_is_not_deployed_says_so_in_its_status(
    tmp_path: Path,
) -> None:
    from stepstream.engine.api.workflow import Registry
    from tests import workflows

    config = EmbeddedConfig(data_dir=str(tmp_path / "d"), partitions=1)
    engine = await open_embedded(workflows_of_tests(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("waiter", None, instance_id="orphan")
        await client.start("sleeper", 3600, instance_id="deployed")
    without = Registry([workflows.sleeper])  # a deploy that dropped "waiter"
    engine = await open_embedded(without, config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        status = await client.status("orphan")
        assert status.status == "running"
        assert status.error is not None and "not deployed" in status.error, status
        assert "'waiter'" in status.error and "version '1'" in status.error
        listed = {s.instance_id: s for s in await client.list()}
        assert listed["orphan"].error == status.error
        # Parked like a diverged one: `stepstream list --diverged` finds it.
        assert [i for i, s in listed.items() if s.diverged] == ["orphan"]
        assert (await client.status("deployed")).error is None
    engine = await open_embedded(workflows_of_tests(), config)  # deployed again
    async with Client(engine.make_transport(owns_engine=True)) as client:
        assert (await client.status("orphan")).error is None
        await client.send_event("orphan", "approval", "back")
        assert await client.result("orphan", timeout=10) == "back"


async def test_timers_indexed_in_the_layout_before_instances_keyed_it_still_fire(
    tmp_path: Path,
) -> None:
    """State written by the version that keyed the timer index by timer id alone is
    upgraded when the timer service starts, and its timers fire."""
    from stepstream.consumers import state_keys
    from stepstream.engine.seams import CommitBatch

    config = EmbeddedConfig(data_dir=str(tmp_path / "d"), partitions=1)
    engine = await open_embedded(workflows_of_tests(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("sleeper", 2.0, instance_id="old-timer")
        backend = engine.host._processor("old-timer").backend
        for _ in range(200):
            indexed = list(backend.store.scan(state_keys.TIMER))
            if indexed:
                break
            await asyncio.sleep(0.01)
        [(key, _)] = indexed
        fire_at, instance_id, timer_id = state_keys.split_timer(key)
        old = CommitBatch()
        old.delete(key)
        old.delete(state_keys.timer_by_id(instance_id, timer_id))
        old.put(state_keys.TIMER + fire_at.to_bytes(8, "big") + timer_id.encode(), b"old-timer")
        old.put(state_keys.TIMER_BY_ID + timer_id.encode(), str(fire_at).encode())
        await backend.commit(old)
    engine = await open_embedded(workflows_of_tests(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        result = await client.result("old-timer", timeout=10)
        assert result["slept"] >= 2.0
        store = engine.host._processor("old-timer").backend.store
        assert list(store.scan(state_keys.TIMER)) == []
        assert list(store.scan(state_keys.TIMER_BY_ID)) == []


async def test_an_evicted_coroutine_unwinds_at_eviction_and_records_nothing(
    tmp_path: Path,
) -> None:
    """With a cache of one, loading a second instance evicts the first: its ``finally``
    block runs then (not at some garbage collection), and a ctx call made there records
    nothing. The evicted instance replays when it is needed again."""
    from tests.workflows import UNWOUND

    UNWOUND.clear()
    config = EmbeddedConfig(data_dir=str(tmp_path / "d"), partitions=1, cache_size=1)
    engine = await open_embedded(workflows_of_tests(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("unwinds", None, instance_id="evict-a")
        for _ in range(200):
            if (await client.status("evict-a")).waits:
                break
            await asyncio.sleep(0.01)
        assert UNWOUND == []
        await client.start("arith", 1, instance_id="evict-b")  # evicts evict-a
        await client.result("evict-b", timeout=10)
        assert UNWOUND == ["evict-a"]
        await client.send_event("evict-a", "go", "went")
        assert await client.result("evict-a", timeout=10) == "went"
        # The cleanup step ran once, when the workflow really finished; the eviction
        # recorded nothing (it would have been "cleanup", this one "cleanup#2").
        started = [
            h.attributes["key"]
            for h in await client.history("evict-a")
            if h.type == "StepAttemptStarted"
        ]
        assert started == ["cleanup"]
        assert UNWOUND == ["evict-a", "evict-a"]
