"""The web UI's Schedules page, in a real headless Chromium against `stepstream dev`:
the list with the next run, and the Pause, Resume, Trigger and Delete buttons."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.browser import browser  # noqa: F401  (the fixture)
from tests.dev_server import DevServer, start_dev

WORKFLOWS = "from tests.ui_workflows import leaf  # noqa: F401\n"
expect.set_options(timeout=20_000)


def call(server: DevServer, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(server.url + path, data, headers, method=method)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def server(tmp_path: Path) -> Iterator[DevServer]:
    dev = start_dev(tmp_path, "ui_schedule_flows", WORKFLOWS)
    try:
        yield dev
    finally:
        dev.stop()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:  # noqa: F811
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    yield opened
    context.close()
    assert errors == [], f"script errors in the page: {errors}"


def test_schedules_page_lists_and_controls_them(server: DevServer, page: Page) -> None:
    created = call(
        server,
        "POST",
        "/v1/schedules",
        {"name": "hourly", "workflow": "leaf", "every": 3600, "input": 21},
    )
    assert created["spec"] == "every 3600s"
    page.goto(f"{server.url}/ui#/schedules")
    row = page.locator('#schedules tr[data-schedule="hourly"]')
    expect(row).to_contain_text("every 3600s")
    expect(row).to_contain_text("active")
    expect(row.locator("time")).to_have_attribute(
        "datetime", call(server, "GET", "/v1/schedules/hourly")["next_run_at"]
    )

    row.get_by_role("button", name="Pause schedule hourly").click()
    expect(row).to_contain_text("paused")
    assert call(server, "GET", "/v1/schedules/hourly")["paused"] is True
    row.get_by_role("button", name="Resume schedule hourly").click()
    expect(row).to_contain_text("active")

    row.get_by_role("button", name="Trigger schedule hourly").click()
    link = row.get_by_role("link", name="hourly@")
    expect(link).to_be_visible()
    link.click()
    expect(page.locator("main")).to_contain_text("completed")

    page.goto(f"{server.url}/ui#/schedules")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator('#schedules tr[data-schedule="hourly"]').get_by_role(
        "button", name="Delete schedule hourly"
    ).click()
    expect(page.locator('#schedules tr[data-schedule="hourly"]')).to_have_count(0)
    assert call(server, "GET", "/v1/schedules") == {"schedules": []}


def test_a_cancelled_schedule_shows_it_runs_no_more(server: DevServer, page: Page) -> None:
    call(server, "POST", "/v1/schedules", {"name": "ends", "workflow": "leaf", "every": 3600})
    call(server, "POST", "/v1/instances/~schedule%2Fends/cancel", {"reason": "by hand"})
    page.goto(f"{server.url}/ui#/schedules")
    row = page.locator('#schedules tr[data-schedule="ends"]')
    expect(row).to_contain_text("cancelled")
    expect(row.locator("time")).to_have_count(0)  # no next run
    expect(row.get_by_role("button", name="Pause schedule ends")).to_have_count(0)
    expect(row.get_by_role("button", name="Trigger schedule ends")).to_have_count(0)
    expect(row.get_by_role("button", name="Delete schedule ends")).to_be_visible()
