"""Queues on `stepstream dev --processes 2`: the embedded engine's partitions in two
processes, driven the way a user would (the CLI and an http:// client). The limit holds
across both processes, and `status --json` shows what a pending instance waits for."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest

from stepstream import Client
from tests.dev_server import start_dev
from tests.queue_checks import most_at_once, slot_spans

pytestmark = pytest.mark.slow

WORKFLOWS = (Path(__file__).parents[1] / "queue_workflows.py").read_text()


def scrape(url: str) -> dict[str, float]:
    """Each series of /metrics without its process label, summed over the processes."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("stepstream_queue_"):
            series, value = line.rsplit(" ", 1)
            series = re.sub(r',?process="[^"]*"', "", series).replace("{,", "{")
            out[series] = out.get(series, 0.0) + float(value)
    return out


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
        for _ in range(100):  # admitted first: "next" waits behind it
            if json.loads(dev.cli("status", "holder", "--json").stdout)["status"] == "running":
                break
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
        # The queues' owners count what they recorded (summed over both processes).
        metrics = scrape(dev.url)
        assert metrics['stepstream_queue_waiting{queue="single"}'] == 1
        assert metrics['stepstream_queue_running{queue="single"}'] == 1
        assert metrics['stepstream_queue_running{queue="pool"}'] == 0
        assert metrics['stepstream_queue_admission_wait_seconds_count{queue="pool"}'] == 200
        assert dev.cli("send", "holder", "go").returncode == 0
        done = dev.cli("result", "next", "--json", "--timeout", "30")
        assert json.loads(done.stdout)["result"] == "next", done.stderr
    finally:
        dev.stop()
