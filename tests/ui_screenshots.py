"""The screenshots of the web UI in docs/ui.md, taken in headless Chromium:

    python -m tests.ui_screenshots   # writes docs/img/ui-list.png, ui-instance.png, ui-dark.png

Serves ``tests.ui_workflows`` with ``stepstream dev`` (a fresh data directory), makes a
few instances through the HTTP API and photographs the list and one instance's page.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.browser import chromium_path
from tests.dev_server import DevServer, start_dev

OUT = Path(__file__).resolve().parents[1] / "docs" / "img"


def _post(server: DevServer, path: str, body: Any) -> None:
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    urllib.request.urlopen(request, timeout=30).read()


def main() -> None:
    from playwright.sync_api import sync_playwright

    root = Path(tempfile.mkdtemp(prefix="stepstream-ui-shots-"))
    server = start_dev(root, "shot_flows", "from tests.ui_workflows import *  # noqa\n")
    try:
        for n in range(1, 7):
            _post(server, "/v1/instances", {"workflow": "gate", "instance_id": f"order-{n:03d}"})
        _post(server, "/v1/instances/order-002/events", {"name": "go", "payload": {"ok": True}})
        _post(server, "/v1/instances/order-003/events", {"name": "go", "payload": {"fail": "x"}})
        _post(server, "/v1/instances/order-004/pause", {})
        _post(server, "/v1/instances/order-005/cancel", {"reason": "customer asked"})
        for n in range(7, 10):
            _post(
                server,
                "/v1/instances",
                {"workflow": "instant", "input": n == 8, "instance_id": f"order-{n:03d}"},
            )
        _post(
            server,
            "/v1/instances",
            {
                "workflow": "tour",
                "instance_id": "trip-042",
                "input": {"customer": "ada", "nights": 3},
            },
        )
        time.sleep(1.5)  # the tour's retry, child, saga and sleep take about a second
        OUT.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium_path())
            page = browser.new_page(viewport={"width": 1100, "height": 640})
            page.goto(f"{server.url}/ui#/")
            page.locator("#instances tbody tr").first.wait_for()
            page.screenshot(path=str(OUT / "ui-list.png"))
            page.set_viewport_size({"width": 1100, "height": 1560})
            page.goto(f"{server.url}/ui#/i/trip-042")
            page.locator(".tl-row[data-kind=wait]").first.wait_for()
            page.screenshot(path=str(OUT / "ui-instance.png"))
            dark = browser.new_page(viewport={"width": 1100, "height": 900}, color_scheme="dark")
            dark.goto(f"{server.url}/ui#/i/trip-042")
            dark.locator(".tl-row[data-kind=wait]").first.wait_for()
            # Not the tracebacks: they name this machine's paths.
            dark.locator(".tl-toggle", has_text="flaky").click()
            dark.locator("#timeline, .timeline").first.scroll_into_view_if_needed()
            dark.screenshot(path=str(OUT / "ui-dark.png"))
            browser.close()
    finally:
        server.stop()
    print(f"wrote ui-list.png, ui-instance.png and ui-dark.png in {OUT}")


if __name__ == "__main__":
    main()
