"""A schedule on `stepstream dev`, driven by the CLI (--json) and the HTTP API, survives
kill -9: after the restart every slot from the first on has exactly one instance, the
slots the engine was down over included (within the catch-up window)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.dev_server import DevServer, start_dev

MODULE = "ss_schedule_jobs"
WORKFLOWS = """
from stepstream import Context, workflow


def work(n):
    return n + 1


@workflow("job")
async def job(ctx: Context, n):
    return await ctx.step("work", work, n)


@workflow("hold")
async def hold(ctx: Context, _):
    return await ctx.wait_for_event("go")
"""


def cli_json(server: DevServer, *args: str) -> Any:
    done = server.cli(*args, "--json")
    assert done.returncode == 0, f"{args}: {done.stderr}\n{server.log.read_text()}"
    return json.loads(done.stdout)


def http(server: DevServer, path: str, method: str = "GET") -> tuple[int, Any]:
    data = b"{}" if method == "POST" else None
    headers = {"Content-Type": "application/json"} if data else {}
    request = urllib.request.Request(f"{server.url}{path}", data, headers, method=method)
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, json.loads(response.read())


def until(probe: Any, ok: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not reached in {timeout}s: {value}")
        time.sleep(0.1)


def described(server: DevServer, name: str) -> Any:
    """What ``schedule describe NAME --json`` prints, read over HTTP: a poll of the CLI
    would start a Python process (about a second of CPU) every time."""
    return http(server, f"/v1/schedules/{name}")[1]


def slot_ids(server: DevServer) -> list[str]:
    listed = cli_json(server, "list")
    return sorted(i["instance_id"] for i in listed if i["instance_id"].startswith("s1@"))


def completed(server: DevServer, instance_id: str) -> bool:
    status = until(
        lambda: http(server, f"/v1/instances/{instance_id}")[1],
        lambda s: s["status"] != "running",
    )
    return bool(status["status"] == "completed")


@pytest.mark.slow
def test_schedule_survives_kill9_with_one_instance_per_slot(tmp_path: Path) -> None:
    server = start_dev(tmp_path, MODULE, WORKFLOWS)
    try:
        created = cli_json(
            server,
            "schedule",
            "create",
            "s1",
            "--workflow",
            "job",
            "--every",
            "1",
            "--input",
            "1",
            "--overlap",
            "allow",
        )
        assert created["spec"] == "every 1s" and created["workflow"] == "job"
        until(lambda: described(server, "s1"), lambda d: d["started"] >= 2)
        assert cli_json(server, "schedule", "describe", "s1")["started"] >= 2
        status, listed = http(server, "/v1/schedules")
        assert status == 200 and [s["name"] for s in listed["schedules"]] == ["s1"]
        status, _ = http(server, "/ui/api/schedules/s1/trigger", method="POST")
        assert status == 202
        until(lambda: http(server, "/v1/schedules/s1")[1], lambda d: d["triggered"] == 1)
    finally:
        server.proc.kill()  # kill -9
        server.proc.wait()
    time.sleep(3)  # slots pass while nothing runs
    server = start_dev(tmp_path, MODULE, WORKFLOWS)
    try:
        until(lambda: described(server, "s1"), lambda d: d["started"] >= 8)
        after = cli_json(server, "schedule", "describe", "s1")
        assert after["started"] >= 8 and after["skipped"] == 0, after
        ids = slot_ids(server)
        slots = [i for i in ids if "." not in i.split("@")[1]]  # the trigger's has ms
        assert len(ids) - len(slots) == 1
        seconds = [datetime.fromisoformat(i.split("@")[1]).timestamp() for i in slots]
        # Every second from the first slot on has its instance: none lost, none twice.
        assert seconds == [seconds[0] + n for n in range(len(seconds))], slots
        for instance_id in ids[:5]:
            assert completed(server, instance_id)
        assert cli_json(server, "schedule", "pause", "s1") == {"schedule": "s1", "command": "pause"}
        listed = cli_json(server, "schedule", "list")
        assert listed[0]["paused"] is True and listed[0]["next_run_at"] is None

        # Slots held back by overlap are counted in describe and at /metrics.
        cli_json(server, "schedule", "create", "s2", "--workflow", "hold", "--every", "1")
        held = until(lambda: described(server, "s2"), lambda d: d["skipped_overlap"] >= 2)
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        skipped = re.search(
            r'^stepstream_schedule_slots_skipped_total\{reason="overlap",schedule="s2"\} (\S+)$',
            metrics,
            re.M,
        )
        assert skipped is not None, [line for line in metrics.splitlines() if "schedule" in line]
        assert float(skipped.group(1)) >= held["skipped_overlap"]
        started = re.search(
            r'^stepstream_schedule_instances_started_total\{schedule="s1"\} (\S+)$', metrics, re.M
        )
        assert started is not None and float(started.group(1)) >= after["started"]
    finally:
        server.stop()
