"""Versions of one workflow side by side, through every transport.

Two versions of ``pricing`` (``tests.versioned_workflows``) run in one engine: new
instances get the latest, a client may pin one, and an instance keeps the version it
started with across a restart (its history is replayed against that version's code).
The same cases run on the embedded and the Kafka backend; ``stepstream start --version``
and the ``version`` field of ``POST /v1/instances`` run against a ``stepstream dev``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from stepstream import InvalidPayload, UnknownWorkflow
from stepstream.engine.api.workflow import Registry
from stepstream.producers.client import Client
from tests.dev_server import DevServer, run_cli, start_dev
from tests.restartable import restartable_backend


def _registry() -> Registry:
    registry = Registry()
    registry.add_modules("tests.workflows,tests.versioned_workflows")
    return registry


@pytest.fixture(params=["embedded", "kafka"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """An engine with ``tests.workflows`` and ``tests.versioned_workflows`` registered,
    and a client of it; ``await backend.restart()`` restarts the engine on its state."""
    async with restartable_backend(request, tmp_path, _registry) as made:
        yield made


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def _waiting(client: Client, instance_id: str) -> None:
    """Until the instance waits for "go" (its quote step is recorded)."""
    for _ in range(1000):
        status = await client.status(instance_id)
        if [w.key for w in status.waits] == ["go"]:
            return
        await asyncio.sleep(0.01)
    history = await client.history(instance_id)
    pytest.fail(f"{instance_id} never waited for 'go': {status}\n{history}")


async def test_latest_by_default_pinned_on_request(backend: Any) -> None:
    client: Client = backend.client
    latest = await client.start("pricing", 10, instance_id=_id("latest"))
    pinned = await client.start("pricing", 10, instance_id=_id("pinned"), version="1")
    assert (await client.status(latest)).version == "2"
    assert (await client.status(pinned)).version == "1"
    await client.send_event(latest, "go", "now")
    await client.send_event(pinned, "go", "now")
    assert await client.result(latest, timeout=20) == {"version": "2", "price": 20, "go": "now"}
    assert await client.result(pinned, timeout=20) == {"version": "1", "price": 10}

    # "10" is later than "9" (numbers), though declared first.
    nine = await client.start("rounding", 2.6, instance_id=_id("nine"), version="9")
    ten = await client.start("rounding", 2.6, instance_id=_id("ten"))
    assert await client.result(ten, timeout=20) == "10:3"
    assert await client.result(nine, timeout=20) == "9:2"
    assert (await client.status(ten)).version == "10"
    # Not numbers: the last declared is the latest.
    assert await client.result(await client.start("tax", 1), timeout=20) == "alpha"
    assert await client.result(await client.start("tax", 1, version="beta"), timeout=20) == "beta"
    # An unversioned workflow has its default version "1".
    assert (await client.status(await client.start("arith", 2))).version == "1"


async def test_an_unknown_version_is_refused_naming_the_known_ones(backend: Any) -> None:
    client: Client = backend.client
    instance_id = _id("three")
    with pytest.raises(UnknownWorkflow, match=r"unknown workflow 'pricing' version '3'.*1, 2"):
        await client.start("pricing", 10, instance_id=instance_id, version="3")
    with pytest.raises(UnknownWorkflow, match=r"unknown workflow 'rounding' version '8'.*9, 10"):
        await client.start("rounding", 1, version="8")
    with pytest.raises(UnknownWorkflow, match="unknown workflow 'nope'"):
        await client.start("nope", 1, version="1")
    with pytest.raises(InvalidPayload, match="version"):
        await client.start("pricing", 1, version="")
    with pytest.raises(InvalidPayload, match="version"):
        await client.start("pricing", 1, version=2)  # type: ignore[arg-type]
    # Nothing was started under the refused id: it is still free.
    started = await client.start("pricing", 10, instance_id=instance_id, version="1")
    assert (await client.status(started)).version == "1"


async def test_an_instance_keeps_its_version_across_a_restart(backend: Any) -> None:
    client: Client = backend.client
    old = await client.start("pricing", 7, instance_id=_id("old"), version="1")
    new = await client.start("pricing", 7, instance_id=_id("new"))
    await _waiting(client, old)
    await _waiting(client, new)

    client = await backend.restart()
    # The restarted engine replays each instance against the code of its own version.
    assert (await client.status(old)).version == "1"
    after = await client.start("pricing", 7, instance_id=_id("after"))
    assert (await client.status(after)).version == "2"
    for instance in (old, new, after):
        await client.send_event(instance, "go", "later")
    assert await client.result(old, timeout=20) == {"version": "1", "price": 7}
    assert await client.result(new, timeout=20) == {"version": "2", "price": 14, "go": "later"}
    assert await client.result(after, timeout=20) == {"version": "2", "price": 14, "go": "later"}
    quotes = [h for h in await client.history(old) if h.type == "StepSucceeded"]
    assert len(quotes) == 1, quotes  # recorded once, replayed after the restart


# ---- the CLI and the HTTP API, against `stepstream dev` -----------------------------------

DEV_MODULE = "ss_versioned_flows"
DEV_WORKFLOWS = """
from stepstream import workflow


@workflow("pricing", version="1")
async def pricing_v1(ctx, amount):
    return {"version": "1", "price": amount}


@workflow("pricing", version="2")
async def pricing_v2(ctx, amount):
    return {"version": "2", "price": amount * 2}
"""
DUPLICATE = """
from stepstream import workflow


@workflow("pricing", version="1")
async def first(ctx, amount):
    return 1


@workflow("pricing", version="1")
async def second(ctx, amount):
    return 2
"""


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    root = tmp_path_factory.mktemp("versions-dev")
    # The module listed twice is loaded once: not a duplicate.
    server = start_dev(root, DEV_MODULE, DEV_WORKFLOWS, "--workflows", f"{DEV_MODULE},{DEV_MODULE}")
    try:
        yield server
    finally:
        server.stop()


def _json(done: Any) -> Any:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout)


def test_cli_start_takes_a_version(dev: DevServer) -> None:
    latest = _json(dev.cli("start", "pricing", "--input", "5", "--wait", "--json"))
    assert latest["result"] == {"version": "2", "price": 10}
    pinned = _json(
        dev.cli("start", "pricing", "--input", "5", "--version", "1", "--id", "cli-v1", "--json")
    )
    assert pinned == {"instance_id": "cli-v1"}
    assert _json(dev.cli("status", "cli-v1", "--json"))["version"] == "1"
    waited = _json(
        dev.cli("start", "pricing", "--input", "3", "--version", "1", "--wait", "--json")
    )
    assert waited["result"] == {"version": "1", "price": 3}

    refused = dev.cli("start", "pricing", "--version", "3")
    assert refused.returncode == 1, refused
    assert "version '3'" in refused.stderr and "1, 2" in refused.stderr, refused.stderr
    empty = dev.cli("start", "pricing", "--version", " ")
    assert empty.returncode == 2 and "--version is empty" in empty.stderr, empty.stderr


def test_cli_start_help_explains_versions(dev: DevServer) -> None:
    helped = run_cli(dev.root, "start", "--help")
    assert helped.returncode == 0
    text = " ".join(helped.stdout.split())
    assert "--version V run this version of the workflow" in text, text
    assert "the highest when versions are whole numbers, else the last declared" in text


async def test_http_body_takes_a_version(dev: DevServer) -> None:
    async with aiohttp.ClientSession() as http:

        async def post(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            async with http.post(f"{dev.url}/v1/instances", json=body) as response:
                return response.status, await response.json()

        status, answer = await post(
            {"workflow": "pricing", "input": 4, "instance_id": "http-v1", "version": "1"}
        )
        assert (status, answer) == (201, {"instance_id": "http-v1"})
        status, answer = await post({"workflow": "pricing", "input": 4, "version": None})
        assert status == 201, answer
        unpinned = answer["instance_id"]
        status, answer = await post({"workflow": "pricing", "version": "7"})
        assert status == 404 and answer["error"]["type"] == "UnknownWorkflow", answer
        assert "version '7'" in answer["error"]["message"], answer
        status, answer = await post({"workflow": "pricing", "version": 1})
        assert status == 400 and answer["error"]["type"] == "InvalidPayload", answer
        assert "'version'" in answer["error"]["message"], answer

    async with Client.connect(dev.url) as client:
        assert await client.result("http-v1", timeout=20) == {"version": "1", "price": 4}
        assert await client.result(unpinned, timeout=20) == {"version": "2", "price": 8}
        pinned = await client.start("pricing", 6, version="1")
        assert await client.result(pinned, timeout=20) == {"version": "1", "price": 6}
        assert (await client.status(pinned)).version == "1"
        with pytest.raises(UnknownWorkflow, match=r"version '0'.*1, 2"):
            await client.start("pricing", 6, version="0")


def test_dev_refuses_two_functions_with_one_name_and_version(tmp_path: Path) -> None:
    (tmp_path / "ss_duplicate_flows.py").write_text(DUPLICATE)
    done = run_cli(
        tmp_path,
        *("dev", "--workflows", "ss_duplicate_flows", "--data", str(tmp_path / "data")),
        *("--port", "0"),
        timeout=30,
    )
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"
    assert "workflow 'pricing' version '1' is defined twice" in done.stderr, done.stderr
    assert "ss_duplicate_flows:first" in done.stderr, done.stderr
    assert "ss_duplicate_flows:second" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
