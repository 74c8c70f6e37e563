"""Reading many instances' state at once (evicted sleepers woken by a batch of timers)
gives each the state its own read gives; an instance whose stored state does not decode
is left to its own read, and one never started reads as absent."""

from __future__ import annotations

from pathlib import Path

from stepstream.consumers import state_keys
from stepstream.consumers.instance_store import load_state, load_states
from stepstream.engine.replay.state_json import entry_json, meta_json
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests import conftest
from tests.fakes import FakeStore


async def test_states_read_together_are_the_states_read_one_by_one(tmp_path: Path) -> None:
    config = EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)
    engine = await open_embedded(conftest.test_registry(), config)
    ids = [f"w-{n}" for n in range(12)]
    async with Client(engine.make_transport(owns_engine=True)) as client:
        for n, instance in enumerate(ids):
            await client.start("drain-after-go", 3, instance_id=instance)
            for item in range(n % 3):  # some with buffered events, some without
                await client.send_event(instance, "item", {"n": n, "item": item})
        store = FakeStore(dict(engine.host._processor(ids[0]).backend.store.scan(b"")))

    asked = [*reversed(ids), "never-started", ids[3]]
    together = load_states(store, asked)
    assert set(together) == {*ids, "never-started"}
    assert together["never-started"] is None
    for instance in ids:
        alone, read = load_state(store, instance), together[instance]
        assert alone is not None and read is not None
        assert meta_json(read) == meta_json(alone), instance
        assert {k: entry_json(e) for k, e in read.entries.items()} == {
            k: entry_json(e) for k, e in alone.entries.items()
        }, instance
        assert read.input == alone.input and read.buffered == alone.buffered, instance

    store.data[state_keys.meta(ids[5])] = b"{not json"
    together = load_states(store, ids)
    assert ids[5] not in together  # its own load meets the error, if it is loaded
    assert all(together[i] is not None for i in ids if i != ids[5])
