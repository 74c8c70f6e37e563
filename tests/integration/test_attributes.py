"""Search attributes: ``ctx.set_attributes`` recorded once and merged, and
``list_page(where=...)`` finding instances by them on both backends, over HTTP and from
the CLI; they survive a restart without being recorded again."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from stepstream import Client, InvalidPayload, WorkflowFailed
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from tests import conftest


async def _running(client: Client, instance_id: str) -> None:
    for _ in range(400):
        try:
            if (await client.status(instance_id)).status == "running":
                return
        except Exception:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{instance_id} never ran: {await client.history(instance_id)}")


async def _ids(client: Client, **kwargs: Any) -> list[str]:
    page = await client.list_page(order="id", limit=100, **kwargs)
    return [i.instance_id for i in page.instances]


async def test_where_matches_every_attribute_across_partitions(client: Client) -> None:
    customers = {"t-0": "42", "t-1": "42", "t-2": "7", "t-3": "42", "t-4": "42"}
    for n, (instance_id, customer) in enumerate(customers.items()):
        attrs = {"customer": customer, "amount": 25.0 if n % 2 else 10, "vip": n == 3}
        await client.start("tagged", attrs, instance_id=instance_id)
    for instance_id in customers:
        await _running(client, instance_id)
    assert await _ids(client, where={"customer": "42"}) == ["t-0", "t-1", "t-3", "t-4"]
    # Every key must match; numbers compare as numbers, True is not 1.
    assert await _ids(client, where={"customer": "42", "amount": 25}) == ["t-1", "t-3"]
    assert await _ids(client, where={"vip": True}) == ["t-3"]
    assert await _ids(client, where={"customer": 42}) == []  # text is not a number
    assert await _ids(client, where={"nobody": "x"}) == []
    newest = await client.list_page(where={"customer": "42"}, status="running", limit=2)
    assert len(newest.instances) == 2 and newest.next is not None
    rest = await client.list_page(where={"customer": "42"}, after=newest.next, limit=10)
    seen = [i.instance_id for i in newest.instances + rest.instances]
    assert sorted(seen) == ["t-0", "t-1", "t-3", "t-4"]
    status = await client.status("t-3")
    assert status.attributes == {"customer": "42", "amount": 25.0, "vip": True}

    # A later call merges, and None removes a key.
    await client.send_event("t-0", "more", {"customer": "9", "vip": None, "stage": "paid"})
    await client.result("t-0", timeout=30)
    after = await client.status("t-0")
    assert after.attributes == {"customer": "9", "amount": 10, "stage": "paid"}
    assert await _ids(client, where={"stage": "paid"}) == ["t-0"]
    assert "t-0" not in await _ids(client, where={"customer": "42"})
    with pytest.raises(InvalidPayload, match="str, int, float or bool"):
        await client.list_page(where={"customer": None})  # type: ignore[dict-item]
    # What no attribute can be would match nothing: said, not sent.
    for where, says in (
        ({"amount": math.inf}, "attribute 'amount' is inf; give a finite number"),
        ({"amount": [1, math.nan]}, "attribute 'amount' is nan"),
        ({"amount": 2**64}, "must fit in 64 bits"),
    ):
        with pytest.raises(InvalidPayload, match=re.escape(says)):
            await client.list_page(where=where)


async def test_subclasses_of_the_scalar_types_are_stored_as_their_value(client: Client) -> None:
    """A numpy.float64, an IntEnum or a StrEnum member is the number or text it is: the
    run goes on, and the instance is found by that value."""
    await client.start("tagged-typed", 2.5, instance_id="typed")
    assert await client.result("typed", timeout=30) == "2.5"
    attributes = (await client.status("typed")).attributes
    assert attributes == {"amount": 2.5, "tier": "gold", "level": 3}
    assert [type(attributes[k]) for k in ("amount", "tier", "level")] == [float, str, int]
    assert await _ids(client, where={"tier": "gold", "level": 3}) == ["typed"]


async def test_a_where_names_each_key_once_and_is_a_mapping(client: Client) -> None:
    with pytest.raises(InvalidPayload, match="where has the key 1, which is not text"):
        await client.list_page(where={1: "x"})  # type: ignore[dict-item]
    with pytest.raises(InvalidPayload, match="where is not a JSON object but a list"):
        await client.list_page(where=[("customer", 42)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"customer": [1, 2]}, "attribute 'customer' is a list; give a str, int, float"),
        ({"a=b": "x"}, "contains '='"),
        ({"": "x"}, "must not be empty"),
        ({"note": "x" * 1025}, "1025 characters long; the limit is 1024"),
        ({f"k{n}": n for n in range(65)}, "the limit is 64"),
        # Beyond a 64-bit whole number, the instance's state could not be stored.
        ({"n": 2**64}, "attribute 'n' must fit in 64 bits"),
    ],
)
async def test_bad_attributes_fail_the_run_naming_the_key(
    tmp_path: Path, attributes: dict[str, Any], message: str
) -> None:
    engine = await open_embedded(conftest.test_registry(), EmbeddedConfig(data_dir=str(tmp_path)))
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("tagged", attributes, instance_id="bad")
        with pytest.raises(WorkflowFailed, match="InvalidWorkflowCall") as failed:
            await client.result("bad", timeout=30)
        assert message in str(failed.value)
        assert (await client.status("bad")).attributes == {}
        # The partition goes on.
        await client.start("tagged", {"n": 2**63 - 1}, instance_id="good")
        await client.send_event("good", "more", {})
        await client.result("good", timeout=30)
        assert (await client.status("good")).attributes == {"n": 2**63 - 1}


async def test_attributes_survive_a_restart_and_are_not_recorded_again(tmp_path: Path) -> None:
    config = EmbeddedConfig(data_dir=str(tmp_path), partitions=2)
    engine = await open_embedded(conftest.test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("tagged", {"customer": "42"}, instance_id="r-1")
        await _running(client, "r-1")
    # A new process: the instance is replayed from its state when the event comes.
    engine = await open_embedded(conftest.test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        assert await _ids(client, where={"customer": "42"}) == ["r-1"]
        await client.send_event("r-1", "more", {"stage": "paid"})
        await client.result("r-1", timeout=30)
        types = [r.type for r in await client.history("r-1")]
        assert types.count("AttributesSet") == 2, types
        assert (await client.status("r-1")).attributes == {"customer": "42", "stage": "paid"}
        assert await _ids(client, where={"customer": "42", "stage": "paid"}) == ["r-1"]


def test_cli_and_http_list_by_attributes(tmp_path: Path) -> None:
    from tests.dev_server import start_dev

    server = start_dev(tmp_path, "ui_none", "from tests.workflows import *  # noqa: F403\n")
    try:
        for instance_id, attrs in (
            ("c-1", {"customer": "42", "vip": True}),
            ("c-2", {"customer": 42}),
            ("c-3", {"customer": "7", "vip": True}),
        ):
            started = server.cli(
                "start", "tagged", "--id", instance_id, "--input", json.dumps(attrs)
            )
            assert started.returncode == 0, started.stderr
        for _ in range(200):
            shown = json.loads(server.cli("list", "--where", "vip=true", "--json").stdout)
            if len(shown["instances"]) == 2:
                break
            time.sleep(0.05)
        assert sorted(i["instance_id"] for i in shown["instances"]) == ["c-1", "c-3"]
        # A number typed on the command line finds the number and the same text; a
        # quoted JSON string only the text.
        both = server.cli("list", "--where", "customer=42", "--order", "id", "--json")
        assert [i["instance_id"] for i in json.loads(both.stdout)["instances"]] == ["c-1", "c-2"]
        text = server.cli("list", "--where", 'customer="42"', "--where", "vip=true", "--json")
        rows = json.loads(text.stdout)["instances"]
        assert [(i["instance_id"], i["attributes"]) for i in rows] == [
            ("c-1", {"customer": "42", "vip": True})
        ]
        table = server.cli("list", "--where", "customer=7")
        assert "c-3" in table.stdout and "c-1" not in table.stdout
        # The text shows them as --where takes them: "42" is text, 42 a number.
        assert 'customer="7" vip=true' in table.stdout, table.stdout
        status = server.cli("status", "c-2").stdout
        assert re.search(r"^attributes:\s+customer=42$", status, re.M), status
        bad = server.cli("list", "--where", "customer")
        assert bad.returncode == 2 and "is not KEY=VALUE" in bad.stderr
        twice = server.cli("list", "--where", "customer=42", "--where", "customer=7")
        assert twice.returncode == 2 and "gives 'customer' twice" in twice.stderr

        where = urlencode({"where": json.dumps({"customer": "42"}), "order": "id"})
        page = _get(f"{server.url}/v1/instances?{where}")
        assert [i["instance_id"] for i in page["instances"]] == ["c-1"]
        assert _get(f"{server.url}/v1/instances/c-2")["attributes"] == {"customer": 42}
        for query, expected in (
            ("where=customer:42", "where is not valid JSON"),
            (urlencode({"where": "[1]"}), "where is not a JSON object"),
            (urlencode({"where": '{"customer": 1e999}'}), "attribute 'customer' is inf"),
            (urlencode({"where": '{"a": 1, "a": 2}'}), "where gives 'a' twice"),
            (urlencode({"where": "[" * 1200}), "where is not valid JSON"),  # too deep
            (urlencode({"where": '{"n": 18446744073709551616}'}), "must fit in 64 bits"),
            (urlencode({"where": '{"customer": {"a": 1}}'}), "is a dict; an attribute"),
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
