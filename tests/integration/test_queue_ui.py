"""The web UI's instance page shows what a pending instance waits for: a slot of its
queue (a real headless Chromium against `stepstream dev`, instances made through the
HTTP API)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import Browser, expect

from tests.browser import browser  # noqa: F401  (the fixture)
from tests.dev_server import start_dev

WORKFLOWS = (Path(__file__).parents[1] / "queue_workflows.py").read_text()


def start(url: str, workflow: str, instance_id: str) -> None:
    body = json.dumps({"workflow": workflow, "instance_id": instance_id, "priority": 2})
    request = urllib.request.Request(
        url + "/v1/instances", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 201


def until_running(url: str, instance_id: str) -> None:
    for _ in range(500):
        with urllib.request.urlopen(f"{url}/v1/instances/{instance_id}", timeout=30) as answer:
            if json.loads(answer.read())["status"] == "running":
                return
        time.sleep(0.02)
    raise AssertionError(f"{instance_id} was never admitted")


def test_the_instance_page_shows_a_wait_for_a_queue_slot(
    browser: Browser,  # noqa: F811
    tmp_path: Path,
) -> None:
    dev = start_dev(tmp_path, "queue_flows", WORKFLOWS)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        start(dev.url, "gate", "holder")
        until_running(dev.url, "holder")  # admitted first: "next" waits behind it
        start(dev.url, "quick", "next")
        page = context.new_page()
        page.goto(f"{dev.url}/ui#/i/next")
        expect(page.locator("#waits")).to_contain_text(
            "a slot of queue ~queue/single, position 1 of 1 waiting"
        )
        expect(page.locator(".meta")).to_contain_text("pending")
    finally:
        context.close()
        dev.stop()
