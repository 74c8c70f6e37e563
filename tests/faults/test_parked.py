"""History that no longer matches the code parks the instance instead of failing it.

A workflow is changed under the same name and version (a renamed step) while an instance
waits. The engine restarted with the new code parks the instance: status running, the
error names the key, nothing the replay decided is recorded, and an event sent meanwhile
is kept. Restarted with code that matches, the instance goes on and uses that event.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from stepstream import Client
from tests.dev_server import start_dev

REPO = str(Path(__file__).resolve().parents[2])

ORIGINAL = """
from stepstream import Context, workflow

def echo(x):
    return x

@workflow("order")
async def order(ctx: Context, _):
    first = await ctx.step("reserve", echo, "reserved")
    got = await ctx.wait_for_event("go")
    return [first, got, await ctx.step("ship", echo, "shipped")]
"""
RENAMED = ORIGINAL.replace('"reserve"', '"hold"')


async def test_a_diverged_instance_is_parked_and_goes_on_with_matching_code(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from stepstream.engine.api.workflow import Registry
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded

    config = EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)

    def registry(source: str, module: str) -> Registry:
        (tmp_path / f"{module}.py").write_text(source)
        sys.path.insert(0, str(tmp_path))
        try:
            found = Registry()
            found.add_module(module)
            return found
        finally:
            sys.path.remove(str(tmp_path))

    engine = await open_embedded(registry(ORIGINAL, "flows_v1"), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("order", None, instance_id="o-1")
        for _ in range(200):
            if (await client.status("o-1")).waits:
                break
    engine = await open_embedded(registry(RENAMED, "flows_changed"), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        with caplog.at_level(logging.WARNING, logger="stepstream"):
            status = await client.status("o-1")
        # The warning names the instance and its workflow (fields of a JSON log line).
        assert any(
            r.getMessage().startswith("instance parked")
            and (r.__dict__.get("instance_id"), r.__dict__.get("workflow")) == ("o-1", "order")
            for r in caplog.records
        ), caplog.text
        assert status.status == "running" and status.diverged, status
        assert status.error is not None and "'reserve'" in status.error
        await client.send_event("o-1", "go", "kept")  # recorded while parked
        history = [h.type for h in await client.history("o-1")]
        assert "StepAttemptStarted" not in history[2:]  # the new step 'hold' never ran
        assert "WorkflowFailed" not in history
        assert [i.instance_id for i in await client.list() if i.diverged] == ["o-1"]
        await client.start("order", None, instance_id="o-2")  # the new code: not parked
    # Served with the same code, the CLI's pages (newest first) keep the parked one.
    server = start_dev(tmp_path, "flows_changed", RENAMED)
    try:
        for args, expected in ((["--diverged"], ["o-1"]), ([], ["o-2", "o-1"])):
            listed = server.cli("list", *args, "--json")
            assert listed.returncode == 0, listed.stderr
            assert [i["instance_id"] for i in json.loads(listed.stdout)] == expected, args
    finally:
        server.stop()
    engine = await open_embedded(registry(ORIGINAL, "flows_v1_again"), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        assert await client.result("o-1", timeout=10) == ["reserved", "kept", "shipped"]
        assert not (await client.status("o-1")).diverged


def test_list_diverged_is_in_the_cli_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stepstream.ops.cli", "list", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    assert "--diverged" in out and "parked" in out


PATCHED = """
from stepstream import Context, workflow

def echo(x):
    return x

@workflow("order")
async def order(ctx: Context, _):
    first = await ctx.step("reserve", echo, "reserved")
    if ctx.patched("insure"):
        await ctx.step("insure", echo, "insured")
    got = await ctx.wait_for_event("go")
    return [first, got, await ctx.step("ship", echo, "shipped")]
"""


async def test_a_patched_deploy_keeps_old_instances_on_the_old_path(tmp_path: Path) -> None:
    from stepstream.engine.api.workflow import Registry
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded

    config = EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=1)
    sys.path.insert(0, str(tmp_path))
    try:
        (tmp_path / "flows_before.py").write_text(ORIGINAL)
        (tmp_path / "flows_patched.py").write_text(PATCHED)
        before, patched = Registry(), Registry()
        before.add_module("flows_before")
        patched.add_module("flows_patched")
    finally:
        sys.path.remove(str(tmp_path))
    engine = await open_embedded(before, config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("order", None, instance_id="old")
        for _ in range(200):
            if (await client.status("old")).waits:
                break
    engine = await open_embedded(patched, config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.start("order", None, instance_id="new")
        for instance in ("old", "new"):
            await client.send_event(instance, "go", instance)
        assert await client.result("old", timeout=10) == ["reserved", "old", "shipped"]
        assert await client.result("new", timeout=10) == ["reserved", "new", "shipped"]
        old_keys = [h.attributes.get("key") for h in await client.history("old")]
        new_keys = [h.attributes.get("key") for h in await client.history("new")]
        assert "insure" not in old_keys and "insure" in new_keys
