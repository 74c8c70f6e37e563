"""Paged listing: ``Client.list_page`` and ``GET /v1/instances?limit=`` on both backends,
a short slice merged across partitions without losing or repeating an instance, and a
worker's web UI listing and controlling instances of every worker's partitions."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from stepstream import InvalidPayload, UnknownInstance
from stepstream.consumers.kafka import create_topics
from stepstream.engine.reads.listing import ListQuery
from stepstream.engine.wire.topics import partition_for
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests import conftest
from tests.conftest import ThreadedWorker, kafka_settings
from tests.kafka_broker import Broker


async def _fill(client: Client) -> tuple[list[str], list[str]]:
    """12 waiting instances ("w-00".."w-11") and 5 finished ones ("a-0".."a-4")."""
    waiting = [f"w-{n:02d}" for n in range(12)]
    done = [f"a-{n}" for n in range(5)]
    for instance_id in waiting:
        await client.start("waiter", None, instance_id=instance_id)
    for n, instance_id in enumerate(done):
        await client.start("arith", n, instance_id=instance_id)
    for instance_id in done:
        await client.result(instance_id, timeout=30)
    return waiting, done


async def test_pages_cover_every_instance_once_in_id_order(client: Client) -> None:
    waiting, done = await _fill(client)
    seen: list[str] = []
    after = None
    while True:
        page = await client.list_page(limit=4, after=after, order="id")
        assert len(page.instances) <= 4
        seen += [i.instance_id for i in page.instances]
        after = page.next
        if after is None:
            break
    assert seen == sorted(waiting + done)
    # The old full list still answers as it did.
    assert {i.instance_id for i in await client.list()} == set(waiting + done)


async def test_filters_by_status_workflow_and_prefix(client: Client) -> None:
    waiting, done = await _fill(client)
    completed = await client.list_page(status="completed", order="id")
    assert [i.instance_id for i in completed.instances] == done
    assert completed.next is None
    by_workflow = await client.list_page(workflow="waiter", limit=100, order="oldest")
    # Oldest first by created time: the time each owner applied the start (on Kafka the
    # partitions apply theirs independently, so not always in the order they were sent).
    listed = [(i.created_at, i.instance_id) for i in by_workflow.instances]
    assert listed == sorted(listed) and sorted(i for _, i in listed) == waiting
    prefixed = await client.list_page(prefix="w-1", order="id")
    assert [i.instance_id for i in prefixed.instances] == ["w-10", "w-11"]
    both = await client.list_page(prefix="a-", status="running")
    assert both.instances == [] and both.next is None
    # A misspelled status is refused (it matched nothing, on every transport but http);
    # an empty workflow filters nothing, as over http.
    with pytest.raises(InvalidPayload, match="unknown status 'complete'; use one of"):
        await client.list_page(status="complete")
    anyone = await client.list_page(workflow="", status="completed", order="id")
    assert [i.instance_id for i in anyone.instances] == done


async def test_newest_first_by_default_within_a_time_range(client: Client) -> None:
    """The list an operator wants: newest first, pages that do not shift, a time range
    (``bulk-10`` after ``bulk-2``, not before it as in id order)."""
    ids = [f"bulk-{n}" for n in range(1, 12)]
    for instance_id in ids:
        await client.start("waiter", None, instance_id=instance_id)
        # Started (on Kafka a start returns once its command is durable), and in another
        # millisecond than the next one.
        await _started(client, instance_id)
        await asyncio.sleep(0.002)
    everything = (await client.list_page(prefix="bulk-", order="id")).instances
    assert [i.instance_id for i in everything][:3] == ["bulk-1", "bulk-10", "bulk-11"]
    created = {i.instance_id: i.created_at for i in everything}
    seen: list[str] = []
    after = None
    while True:
        page = await client.list_page(prefix="bulk-", limit=4, after=after)
        seen += [i.instance_id for i in page.instances]
        if page.next is None:
            break
        after = page.next
    assert seen == ids[::-1]
    oldest = await client.list_page(prefix="bulk-", order="oldest", limit=3)
    assert [i.instance_id for i in oldest.instances] == ids[:3]

    since, until = created[ids[2]], created[ids[6]]
    window = await client.list_page(prefix="bulk-", since=since, until=until, order="oldest")
    expected = ids[2:6]
    assert [i.instance_id for i in window.instances] == expected
    by_id = await client.list_page(prefix="bulk-", since=since, until=until, order="id")
    assert [i.instance_id for i in by_id.instances] == sorted(expected)
    recent = await client.list_page(prefix="bulk-", since="1h")
    assert len(recent.instances) == len(ids)
    assert (await client.list_page(prefix="bulk-", until="1h")).instances == []
    with pytest.raises(InvalidPayload, match="is not a time: give an ISO 8601 time"):
        await client.list_page(since="yesterday")
    with pytest.raises(InvalidPayload, match="order='sideways' is not one of"):
        await client.list_page(order="sideways")


async def _started(client: Client, instance_id: str) -> None:
    for _ in range(300):
        try:
            await client.status(instance_id)
            return
        except UnknownInstance:
            await asyncio.sleep(0.05)
    raise AssertionError(f"{instance_id} never started")


async def test_a_short_slice_never_skips_instances(tmp_path: Path) -> None:
    """A partition that stops after a few keys (its budget) says how far it got; the
    merged page never passes it, so going on from each cursor lists everything."""
    engine = await open_embedded(
        conftest.test_registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=3)
    )
    async with Client(engine.make_transport(owns_engine=True)) as client:
        waiting, _ = await _fill(client)
        seen: list[str] = []
        after: str | None = None
        for _ in range(100):
            page = engine.host.list_page(ListQuery(status="running", after=after, limit=3), 2)
            seen += [i.instance_id for i in page.instances]
            if page.next is None:
                break
            after = page.next
        assert seen == waiting


def test_cli_pages_and_bad_page_queries(tmp_path: Path) -> None:
    from tests.dev_server import start_dev

    server = start_dev(tmp_path, "ui_none", "from tests.workflows import *  # noqa: F403\n")
    try:
        for n in range(3):
            started = server.cli("start", "waiter", "--id", f"p-{n}")
            assert started.returncode == 0, started.stderr
        first = server.cli("list", "--prefix", "p-", "--limit", "2", "--order", "id")
        assert first.returncode == 0, first.stderr
        assert "p-0" in first.stdout and "p-1" in first.stdout and "p-2" not in first.stdout
        assert first.stdout.rstrip().endswith(
            "next page: stepstream list --prefix p- --limit 2 --order id --after p-1"
        )
        rest = server.cli("list", "--prefix", "p-", "--after", "p-1", "--order", "id", "--json")
        assert json.loads(rest.stdout)["next"] is None
        assert [i["instance_id"] for i in json.loads(rest.stdout)["instances"]] == ["p-2"]
        refused = server.cli("list", "--limit", "-1")
        assert refused.returncode == 2 and "--limit must be 0 (all) or more" in refused.stderr
        newest = server.cli("list", "--prefix", "p-", "--since", "1h", "--json")
        assert [i["instance_id"] for i in json.loads(newest.stdout)["instances"]] == [
            "p-2",
            "p-1",
            "p-0",
        ]
        bad = server.cli("list", "--since", "a while")
        assert bad.returncode == 2 and "--since 'a while' is not a time" in bad.stderr
        bad = server.cli("list", "--since", "99999999999w")  # before year 1
        assert bad.returncode == 2 and "is not a time" in bad.stderr, bad.stderr
        for query, expected in (
            ("limit=%C2%B2", "is not a whole number from 1 to 500"),  # "²" is a digit
            ("since=99999999999w", "is not a time"),
            ("until=9999-12-31T23:59:59-05:00", "is not a time"),
            ("stauts=running", "unknown query parameter 'stauts'; this call takes after"),
            ("status=running&status=failed", "'status' given more than once"),
            ("limit=0", "limit='0' is not a whole number from 1 to 500"),
            ("limit=x", "limit='x' is not a whole number"),
            ("status=lost&limit=5", "unknown status 'lost'; use one of pending, running"),
            ("order=up", "order='up' is not one of newest, oldest, id"),
            ("since=soon", "since='soon' is not a time"),
            ("order=newest&after=p-1", "after='p-1' is not a cursor of order=newest"),
        ):
            try:
                urllib.request.urlopen(f"{server.url}/v1/instances?{query}", timeout=10)
                raise AssertionError(f"{query} was accepted")
            except urllib.error.HTTPError as exc:
                assert exc.code == 400
                assert expected in json.loads(exc.read())["error"]["message"]
    finally:
        server.stop()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _post(url: str, body: Any) -> int:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(response.status)


async def test_a_workers_ui_covers_every_workers_partitions(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    settings = kafka_settings(kafka_broker)
    create_topics(settings, 2)
    first = ThreadedWorker(settings, tmp_path / "w1", conftest.test_registry())
    second = ThreadedWorker(settings, tmp_path / "w2", conftest.test_registry())
    try:
        first.start(None)
        second.start(None)
        for worker in (first, second):  # one partition each
            worker.call_sync(worker.worker.wait_assigned(1, timeout=60))
        ids = [f"k-{n}" for n in range(8)]
        assert {partition_for(i, 2) for i in ids} == {0, 1}
        async with Client.connect(f"kafka://{settings.bootstrap}?prefix={settings.prefix}") as c:
            for instance_id in ids:
                await c.start("waiter", None, instance_id=instance_id)
            ui = first.worker.url + "/ui/api"
            page = await asyncio.to_thread(_get, f"{ui}/instances?limit=5")
            second_page = await asyncio.to_thread(
                _get, f"{ui}/instances?limit=5&after={page['next']}"
            )
            listed = [i["instance_id"] for i in page["instances"] + second_page["instances"]]
            assert listed == ids and second_page["next"] is None
            newest = await asyncio.to_thread(_get, f"{ui}/instances?limit=5&order=newest")
            older = await asyncio.to_thread(
                _get, f"{ui}/instances?limit=5&order=newest&after={quote(newest['next'])}"
            )
            rows = newest["instances"] + older["instances"]
            listed = [i["instance_id"] for i in rows]
            positions = [(i["created_at"], i["instance_id"]) for i in rows]
            assert sorted(listed) == ids and older["next"] is None
            assert positions == sorted(positions, reverse=True)
            # An instance on the other worker's partition, controlled from this UI.
            elsewhere = next(i for i in ids if partition_for(i, 2) not in first.worker.owned)
            code = await asyncio.to_thread(
                _post, f"{ui}/instances/{elsewhere}/events", {"name": "approval", "payload": 7}
            )
            assert code == 202
            assert await c.result(elsewhere, timeout=30) == 7
            shown = await asyncio.to_thread(_get, f"{ui}/instances/{elsewhere}")
            assert shown["status"]["status"] == "completed" and shown["result"] == 7
    finally:
        second.stop()
        first.stop()
