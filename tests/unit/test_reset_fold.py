"""A reset's state is the fold of the whole history: folding the records that an owner
wrote (as a Kafka restore does, from the history topic, with no local state) gives the
state that owner holds, and the same again after a second reset and a fork."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from stepstream import WorkflowFailed
from stepstream.consumers.instance_store import load_state
from stepstream.consumers.restore import Restorer
from stepstream.engine.api.workflow import Registry
from stepstream.engine.replay.reset import fold, set_aside
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.replay.state_json import entry_json, meta_json
from stepstream.engine.wire.records import HistoryRecord
from stepstream.engine.wire.serde import default_serde
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests import conftest
from tests.fakes import FakeStore


def _restored(records: list[HistoryRecord]) -> InstanceState:
    """The state a restore from the history topic (no local state) makes of ``records``."""
    serde = default_serde()
    restorer = Restorer(FakeStore(), serde)
    for record in records:
        restorer.apply(serde.encode(record))
    restored_store = FakeStore()
    restored_store.data.update(restorer.batch().puts)
    restored = load_state(restored_store, records[0].instance_id)
    assert restored is not None
    return restored


def _stored(state: InstanceState) -> tuple[bytes, dict[str, bytes], list[str]]:
    return (
        meta_json(state),
        {k: entry_json(e) for k, e in state.entries.items()},
        [b.command_id for b in state.buffered],
    )


async def test_restore_folds_resets_to_the_owners_state(tmp_path: Path, ledger: Path) -> None:
    engine = await open_embedded(
        conftest.test_registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)
    )
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("repairable", {}, instance_id="o-1")
        await client.send_event("o-1", "go", {"by": "ada"})
        with pytest.raises(WorkflowFailed):
            await client.result("o-1", timeout=20)
        await client.reset("o-1", to="charge#2")
        with pytest.raises(WorkflowFailed):
            await client.result("o-1", timeout=20)
        await client.reset("o-1", to="go")
        with pytest.raises(WorkflowFailed):
            await client.result("o-1", timeout=20)
        await client.fork("o-1", to="ship", instance_id="o-2")
        with pytest.raises(WorkflowFailed):
            await client.result("o-2", timeout=20)
        host = engine.host
        for instance in ("o-1", "o-2"):
            records = host.read_history(instance)
            owner = host.read_state(instance)
            assert _stored(_restored(records)) == _stored(owner), instance
            assert _stored(fold(instance, records))[1] == _stored(owner)[1]
        records = host.read_history("o-1")
        first = next(r.seq for r in records if getattr(r, "key", "") == "charge#2")
        assert min(set_aside(records)) == first  # what came before the key still counts


async def test_slots_a_reset_or_fork_gave_back_fold_the_same(tmp_path: Path) -> None:
    """A queued run asked its queue again after a reset and a fork: restored from the
    history, each is the owner's state (the slot asked for again, the admission given
    back gone), while it waits for the queue and once it went on."""
    registry = Registry()
    registry.add_module("tests.queue_workflows")
    engine = await open_embedded(
        registry, EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)
    )
    ledger = str(tmp_path / "ledger")
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("two-steps", ledger, instance_id="d")
        await client.result("d", timeout=20)
        await client.start("gate", None, instance_id="holder")
        while (await client.status("holder")).status != "running":
            await asyncio.sleep(0.02)
        await client.fork("d", to="second", instance_id="f")
        await client.reset("d", to="second")
        await client.reset("d", to="first")  # a second reset, its slot still waited for
        host = engine.host
        for _ in range(200):
            if all(host.read_state(i).requeued for i in ("d", "f")):
                break
            await asyncio.sleep(0.02)
        for instance in ("d", "f"):
            owner = host.read_state(instance)
            assert owner.requeued == {"queue": 1}, instance
            assert "queue" not in owner.entries and "queue#ask2" in owner.entries
            assert _stored(_restored(host.read_history(instance))) == _stored(owner), instance
        await client.send_event("holder", "go", None)
        for instance in ("d", "f"):
            await client.result(instance, timeout=20)
            records = host.read_history(instance)
            owner = host.read_state(instance)
            assert _stored(_restored(records)) == _stored(owner), instance
            assert _stored(fold(instance, records))[1] == _stored(owner)[1]
