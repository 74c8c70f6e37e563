"""Queues on `stepstream dev --processes 2`: the embedded engine's partitions in two
processes, driven the way a user would (the CLI and an http:// client). The limit holds
across both processes, and `status --json` shows what a pending instance waits for."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from stepstream import Client
from tests.dev_server import start_dev
from tests.queue_checks import most_at_once, slot_spans

pytestmark = pytest.mark.slow

WORKFLOWS = (Path(__file__).parents[1] / "queue_workflows.py").read_text()


async def run_pooled(url: str, count: int) -> list[tuple[int, int]]:
    async with Client.connect(url) as client:
        ids = [await client.start("pooled", 0.05, instance_id=f"p-{n}") for n in range(count)]
        for i in ids:
            assert await client.result(i, timeout=120) == 0.05
        return [s for i in ids for s in slot_spans(await client.history(i))]


def test_a_queue_limits_both_processes_and_status_shows_the_wait(tmp_path: Path) -> None:
    dev = start_dev(tmp_path, "queue_flows", WORKFLOWS, "--processes", "2")
    try:
        spans = asyncio.run(run_pooled(dev.url, 200))
        assert len(spans) == 200
        assert 1 < most_at_once(spans) <= 5

        started = dev.cli("start", "gate", "--id", "holder")
        assert started.returncode == 0, started.stderr
        waiting = dev.cli("start", "quick", "--id", "next", "--priority", "3")
        assert waiting.returncode == 0, waiting.stderr
        for _ in range(100):
            shown = json.loads(dev.cli("status", "next", "--json").stdout)
            if shown["waits"]:
                break
        assert shown["status"] == "pending", shown
        assert [(w["kind"], w["queue"]) for w in shown["waits"]] == [("queue", "~queue/single")]
        text = dev.cli("status", "next").stdout
        assert "for a slot of ~queue/single" in text, text
        assert dev.cli("send", "holder", "go").returncode == 0
        done = dev.cli("result", "next", "--json", "--timeout", "30")
        assert json.loads(done.stdout)["result"] == "next", done.stderr
    finally:
        dev.stop()
