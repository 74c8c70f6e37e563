"""Newest-first lists (the UI's, ``GET /v1/instances``', the CLI's and ``Client.list_page``'s
default order) on the embedded backend, read from each partition's index by created time:
an instance started again lists once, at its new start; a reset keeps its place;
instances retention forgets leave the index; and a data directory written before the
index existed lists newest first once opened, with the index built."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from stepstream import WorkflowFailed
from stepstream.consumers import state_keys as keys
from stepstream.consumers.embedded import keys as embedded_keys
from stepstream.consumers.embedded.db import EmbeddedDB
from stepstream.consumers.embedded.partition import EmbeddedStore
from stepstream.engine.wire.topics import partition_for
from stepstream.ops.embedded import EmbeddedConfig, EmbeddedEngine, open_embedded
from stepstream.producers.client import Client
from tests.conftest import test_registry as workflows_of_tests
from tests.integration.test_workflows import wait_for_status

PARTITIONS = 3


async def _ids(client: Client, order: str = "newest", prefix: str = "n-") -> list[str]:
    """Every instance under ``prefix`` in ``order``, two a page."""
    seen: list[str] = []
    after = None
    while True:
        page = await client.list_page(prefix=prefix, limit=2, after=after, order=order)
        seen += [i.instance_id for i in page.instances]
        if page.next is None:
            return seen
        after = page.next


async def _by_created(client: Client, ids: list[str]) -> list[str]:
    """``ids`` newest first by the created time their status shows, ties by id."""
    created = {i: (await client.status(i)).created_at for i in ids}
    return sorted(ids, key=lambda i: (created[i], i), reverse=True)


def _indexed(db: EmbeddedDB) -> list[tuple[int, str]]:
    """Every (created ms, instance id) of every partition's index by created time."""
    return sorted(
        keys.split_started(key)
        for partition in range(PARTITIONS)
        for key, _ in EmbeddedStore(db, partition).scan(keys.STARTED)
    )


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[EmbeddedEngine]:
    opened = await open_embedded(
        workflows_of_tests(),
        EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=PARTITIONS),
    )
    yield opened
    await opened.close()


async def test_a_new_run_moves_the_instance_to_its_new_start(engine: EmbeddedEngine) -> None:
    client = Client(engine.make_transport())
    await client.start("boom", None, instance_id="n-0")
    with pytest.raises(WorkflowFailed):
        await client.result("n-0", timeout=20)
    for n in range(1, 5):
        await client.start("arith", n, instance_id=f"n-{n}")
        await client.result(f"n-{n}", timeout=20)
    first = await client.status("n-0")
    assert await _ids(client) == ["n-4", "n-3", "n-2", "n-1", "n-0"]

    await client.start("boom", None, instance_id="n-0", if_exists="restart_if_failed")
    await wait_for_status(client, "n-0", lambda s: s.run == 2 and s.status == "failed")
    assert (await client.status("n-0")).created_at > first.created_at
    newest = await _ids(client)
    assert newest == ["n-0", "n-4", "n-3", "n-2", "n-1"]
    assert await _ids(client, "oldest") == newest[::-1]

    # A reset goes on from a step of the same run: the instance keeps its place.
    before = (await client.status("n-2")).updated_at
    await client.reset("n-2", to="double", reason="again")
    await wait_for_status(
        client, "n-2", lambda s: s.status == "completed" and s.updated_at > before
    )
    assert "WorkflowReset" in [h.type for h in await client.history("n-2")]
    assert await _ids(client) == newest == await _by_created(client, newest)
    # One key each, at the start each status shows.
    assert [i for _, i in _indexed(engine.db)] == sorted(newest, key=newest[::-1].index)


async def test_instances_retention_forgets_leave_the_list(tmp_path: Path) -> None:
    config = EmbeddedConfig(
        data_dir=str(tmp_path / "data"),
        partitions=PARTITIONS,
        retention_s=0.5,
        sweep_interval_s=0.05,
    )
    engine = await open_embedded(workflows_of_tests(), config)
    try:
        client = Client(engine.make_transport())
        for n in range(6):
            await client.start("arith", n, instance_id=f"n-{n}")
        await client.start("waiter", None, instance_id="n-kept")
        for n in range(6):
            await client.result(f"n-{n}", timeout=20)
        for _ in range(300):
            if await _ids(client) == ["n-kept"]:
                break
            await asyncio.sleep(0.02)
        assert await _ids(client) == ["n-kept"]
        assert [i for _, i in _indexed(engine.db)] == ["n-kept"]
    finally:
        await engine.close()


async def test_a_store_written_before_the_index_lists_newest_first(tmp_path: Path) -> None:
    config = EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=PARTITIONS)
    engine = await open_embedded(workflows_of_tests(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        for n in range(8):
            await client.start("waiter" if n % 2 else "arith", n, instance_id=f"n-{n}")
        await client.result("n-6", timeout=20)
        expected = await _by_created(client, [f"n-{n}" for n in range(8)])
        made = _indexed(engine.db)
    assert len(made) == 8

    # As an older version left it: no index by created time, no mark that it is built.
    db = await EmbeddedDB.open(config.data_dir, PARTITIONS)
    try:
        old = []
        for partition in range(PARTITIONS):
            own = embedded_keys.state_user_prefix(partition)
            store = EmbeddedStore(db, partition)
            old += [own + key for key, _ in store.scan(keys.STARTED)]
            if store.get(keys.STARTED_INDEXED) is not None:
                old.append(own + keys.STARTED_INDEXED)
        await db.write(deletes=old)
        assert _indexed(db) == []
    finally:
        await db.close()

    engine = await open_embedded(workflows_of_tests(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        assert await _ids(client) == expected
        assert await _ids(client, "oldest") == expected[::-1]
        assert _indexed(engine.db) == made  # built again when the partitions resumed
        for partition in range(PARTITIONS):  # marked whole by this owner
            store = EmbeddedStore(engine.db, partition)
            assert store.get(keys.STARTED_INDEXED) == str(engine.db.epoch).encode()


async def test_instances_an_older_version_started_after_a_rollback_are_listed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """This version runs, an older one (which keeps neither the index by created time
    nor the one by finish time) runs on the same directory, then this version again:
    what the older one started is listed, newest first, and its finished instances are
    where retention looks, without anyone rebuilding anything by hand. A restart with
    nothing in between reads no meta to find that out."""
    config = EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=PARTITIONS)
    engine = await open_embedded(workflows_of_tests(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        for n in range(4):
            await client.start("arith", n, instance_id=f"n-{n}")
        await client.result("n-3", timeout=20)
        marks = _marks(engine.db)

    # The rollback: the older version opens the directory (counting its epoch up by one,
    # as every open does) and starts instances. Played by this version, then made to look
    # as the older one leaves it: no index keys for what it started, the marks as they
    # were before it ran.
    engine = await open_embedded(workflows_of_tests(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        for n in range(4, 8):
            await client.start("waiter" if n % 2 else "arith", n, instance_id=f"n-{n}")
        await client.result("n-6", timeout=20)
        expected = await _by_created(client, [f"n-{n}" for n in range(8)])
        made, finished = _indexed(engine.db), _finished(engine.db)
        older = {f"n-{n}" for n in range(4, 8)}
        gone = []
        for partition in range(PARTITIONS):
            own = embedded_keys.state_user_prefix(partition)
            store = EmbeddedStore(engine.db, partition)
            gone += [
                own + key
                for key, _ in store.scan(keys.STARTED)
                if keys.split_started(key)[1] in older
            ]
            gone += [
                own + key
                for key, _ in store.scan(keys.FINISHED)
                if keys.split_finished(key)[1] in older
            ]
        await engine.db.write(deletes=gone, puts=list(marks.items()))
        assert len(gone) == 6 and len(_indexed(engine.db)) == 4  # n-4 and n-6 finished

    caplog.set_level(logging.INFO, logger="stepstream.partition")
    engine = await open_embedded(workflows_of_tests(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        assert await _ids(client) == expected
        assert _indexed(engine.db) == made  # made whole when the partitions resumed
        assert _finished(engine.db) == finished
        assert set(_marks(engine.db).values()) == {str(engine.db.epoch).encode()}
    assert any(r.getMessage().startswith("indexed ") for r in caplog.records)

    caplog.clear()
    engine = await open_embedded(workflows_of_tests(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        assert await _ids(client) == expected
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("indexed ")]


async def test_a_finish_key_an_older_reset_left_is_not_counted_as_finished(
    engine: EmbeddedEngine,
) -> None:
    """An older release that resets a finished instance during a rollback leaves its
    key in the index by finish time: the overview's last hour counts what finished,
    not what that key says."""
    transport = engine.make_transport()
    client = Client(transport)
    await client.start("arith", 1, instance_id="n-done")
    await client.result("n-done", timeout=20)
    await client.start("waiter", 1, instance_id="n-again")
    await wait_for_status(client, "n-again", lambda s: bool(s.waits))
    partition = partition_for("n-again", PARTITIONS)
    left = embedded_keys.state_user_prefix(partition) + keys.finished(
        engine.host.clock.now_ms() - 60_000, "n-again"
    )
    await engine.db.write(puts=[(left, b"")])
    overview = await transport.overview()
    assert overview.finished_last_hour == {"completed": 1}
    assert sum(overview.counts.values()) == 2


def _finished(db: EmbeddedDB) -> list[tuple[int, str]]:
    """Every (finished ms, instance id) of every partition's index by finish time."""
    return sorted(
        keys.split_finished(key)
        for partition in range(PARTITIONS)
        for key, _ in EmbeddedStore(db, partition).scan(keys.FINISHED)
    )


def _marks(db: EmbeddedDB) -> dict[bytes, bytes]:
    """Every partition's index marks, by their full keys."""
    found = {}
    for partition in range(PARTITIONS):
        own = embedded_keys.state_user_prefix(partition)
        store = EmbeddedStore(db, partition)
        for key in (keys.STARTED_INDEXED, keys.FINISHED_INDEXED):
            value = store.get(key)
            assert value is not None
            found[own + key] = value
    return found
