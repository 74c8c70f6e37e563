"""Reset, retry and fork through the CLI (``--json``), the HTTP API and an ``http://``
client, against a real ``stepstream dev`` serving ``examples/shipment.py`` as
docs/operations-on-instances.md runs it."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from stepstream import Client
from stepstream.errors import InstanceNotFailed, UnknownReplayKey
from tests.dev_server import DevServer, spawn_dev


@pytest.fixture
def dev(tmp_path: Path) -> Iterator[DevServer]:
    server, _ = spawn_dev(
        tmp_path, ["dev", "--workflows", "examples.shipment", "--data", "data", "--port", "0"]
    )
    yield server
    server.stop()


def ok_json(dev: DevServer, *args: str) -> Any:
    done = dev.cli(*args, "--json")
    assert done.returncode == 0, f"stepstream {' '.join(args)}: {done.stderr}{done.stdout}"
    return json.loads(done.stdout)


def refused(dev: DevServer, *args: str) -> dict[str, Any]:
    done = dev.cli(*args, "--json")
    assert done.returncode == 1, f"{done.returncode}: {done.stdout}{done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: "), done.stderr
    return {"stderr": done.stderr}


def test_cli_reset_retry_and_fork(dev: DevServer) -> None:
    order = '{"amount": 25, "to": "Ada, 1 Main St"}'
    failed = dev.cli("start", "shipment", "--input", order, "--id", "s-1", "--wait")
    assert failed.returncode == 1 and "warehouse is closed" in failed.stderr

    bad = refused(dev, "reset", "s-1", "--to", "pack")
    assert "UnknownReplayKey" in bad["stderr"] or "no replay key 'pack'" in bad["stderr"]
    assert "charge, label, ship" in bad["stderr"]

    (dev.root / "warehouse-open").touch()
    assert ok_json(dev, "retry", "s-1") == {"instance_id": "s-1", "command": "retry", "reason": ""}
    done = ok_json(dev, "result", "s-1")
    assert done["status"] == "completed"
    assert done["result"]["ship"] == "shipped with label for Ada, 1 Main St"
    assert "not failed" in refused(dev, "retry", "s-1")["stderr"]

    reset = ok_json(dev, "reset", "s-1", "--to", "label", "--reason", "new label")
    assert reset == {
        "instance_id": "s-1",
        "command": "reset",
        "to": "label",
        "reason": "new label",
    }
    assert ok_json(dev, "result", "s-1")["status"] == "completed"
    history = ok_json(dev, "history", "s-1")
    resets = [h for h in history if h["type"] == "WorkflowReset"]
    assert [r["attributes"]["to"] for r in resets] == ["ship", "label"]
    assert any(h["set_aside"] for h in history)
    timeline = dev.cli("history", "s-1").stdout
    # The timeline shows what counts: the retry was set aside by the reset after it.
    assert re.search(r"reset +label +goes on +set aside seq \d+-\d+  new label", timeline), timeline
    assert "retry" not in timeline, timeline

    forked = ok_json(dev, "fork", "s-1", "--to", "ship", "--id", "s-2")
    assert forked == {"instance_id": "s-2", "command": "fork", "forked_from": "s-1", "to": "ship"}
    assert ok_json(dev, "result", "s-2")["status"] == "completed"
    assert ok_json(dev, "status", "s-2")["origin"] == "forked from s-1 at ship"
    assert "origin" in dev.cli("status", "s-2").stdout


async def test_http_api_and_http_client(dev: DevServer) -> None:
    async with Client.connect(dev.url) as client:
        await client.start("shipment", {"amount": 3, "to": "Bob"}, instance_id="h-1")
        with pytest.raises(Exception, match="warehouse is closed"):
            await client.result("h-1", timeout=20)
        with pytest.raises(UnknownReplayKey, match="charge, label, ship"):
            await client.reset("h-1", to="nope")
        async with aiohttp.ClientSession() as http:
            base = f"{dev.url}/v1/instances"
            async with http.post(f"{base}/h-1/reset", json={"to": "nope"}) as answer:
                body = await answer.json()
                assert answer.status == 400, body
                assert body["error"]["type"] == "UnknownReplayKey"
            (dev.root / "warehouse-open").touch()
            async with http.post(f"{base}/h-1/retry", json={}) as answer:
                assert answer.status == 202, await answer.text()
            assert (await client.result("h-1", timeout=20))["ship"].startswith("shipped")
            async with http.post(f"{base}/h-1/retry", json={}) as answer:
                body = await answer.json()
                assert answer.status == 409 and body["error"]["type"] == "InstanceNotFailed"
            async with http.post(
                f"{base}/h-1/fork", json={"to": "label", "instance_id": "h-2"}
            ) as answer:
                assert answer.status == 201, await answer.text()
                assert (await answer.json())["instance_id"] == "h-2"
            async with http.post(
                f"{base}/h-1/fork", json={"to": "label", "instance_id": "h-2"}
            ) as answer:
                body = await answer.json()
                assert answer.status == 409 and body["error"]["type"] == "InstanceExists", body
        assert (await client.result("h-2", timeout=20))["ship"].startswith("shipped")
        assert (await client.status("h-2")).origin == "forked from h-1 at label"
        with pytest.raises(InstanceNotFailed):
            await client.retry("h-2")
        await client.reset("h-1", to="ship", reason="again")
        assert (await client.result("h-1", timeout=20))["charge"] == "charged 3"
        history = await client.history("h-1")
        assert [h.seq for h in history if h.set_aside]


PAGE = Path(__file__).resolve().parents[2] / "docs" / "operations-on-instances.md"


def test_the_page_runs_as_typed(tmp_path: Path) -> None:
    """docs/operations-on-instances.md's "Try it": its dev command, then each line of
    the block after it, as written; a line whose comment says it fails or is refused
    must exit 1, every other 0."""
    section = PAGE.read_text().split("## Try it", 1)[1]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    serve = shlex.split(blocks[0].strip())
    assert serve[:2] == ["stepstream", "dev"]
    server, _ = spawn_dev(tmp_path, [*serve[1:], "--port", "0"])
    try:
        outputs = {}
        for line in blocks[1].strip().splitlines():
            command, _, comment = line.partition("#")
            args = shlex.split(command)
            if args[0] == "touch":
                (tmp_path / args[1]).touch()
                continue
            assert args[0] == "stepstream", line
            done = server.cli(*args[1:])
            expected = 1 if comment.strip().startswith(("fails", "refused")) else 0
            assert done.returncode == expected, f"{line}\n{done.stdout}{done.stderr}"
            outputs.setdefault(" ".join(args[1:3]), done.stdout + done.stderr)
        assert "charge, label, ship" in outputs["reset s-1"]
        assert "forked from s-1 at ship" in outputs["status s-2"]
        assert '"set_aside": true' in outputs["history s-1"]
    finally:
        server.stop()
