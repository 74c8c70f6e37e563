"""The instance page's Retry, Reset and Fork, in a real headless Chromium against
`stepstream dev` serving examples/shipment.py: Retry shows on a failed instance only,
the key picker offers the timeline's steps, set-aside records are shown as such, and a
fork links back to where it came from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.browser import browser  # noqa: F401  (the fixture)
from tests.dev_server import DevServer, start_dev
from tests.integration.test_web_ui import call, start

expect.set_options(timeout=20_000)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[DevServer]:
    dev = start_dev(
        tmp_path, "ui_shipments", "from examples.shipment import shipment  # noqa: F401\n"
    )
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


def test_retry_reset_and_fork_from_the_instance_page(server: DevServer, page: Page) -> None:
    start(server, "shipment", "u-1", {"amount": 5, "to": "Ada"})
    page.goto(f"{server.url}/ui#/i/u-1")
    badge = page.locator(".meta .badge")
    notice = page.locator(".notice").last
    expect(badge).to_have_text("failed")
    retry = page.get_by_role("button", name="Retry")
    expect(retry).to_be_visible()
    keys = page.locator("#r-key option")
    expect(keys).to_have_text(["charge", "label", "ship"])

    (server.root / "warehouse-open").touch()
    retry.click()
    expect(badge).to_have_text("completed")
    expect(retry).to_be_hidden()  # only a failed instance can be retried
    expect(page.locator("#history tr.set-aside").first).to_contain_text("set aside by a reset")

    page.locator("#r-key").select_option("label")
    page.get_by_label("Note for the history").fill("reprint")
    page.get_by_role("button", name="Reset").click()
    expect(notice).to_contain_text("goes on from just before label")
    expect(badge).to_have_text("completed")
    history = call(server, "GET", "/v1/instances/u-1/history")["history"]
    resets = [e for e in history if e["type"] == "WorkflowReset"]
    assert [r["attributes"]["to"] for r in resets] == ["ship", "label"]
    assert resets[-1]["attributes"]["reason"] == "reprint"

    page.locator("#r-key").select_option("ship")
    page.get_by_label("New instance id").fill("u-2")
    page.get_by_role("button", name="Fork from the same key").click()
    page.locator("#r-forked").click()
    expect(page.locator("h1")).to_have_text("u-2")
    expect(badge).to_have_text("completed")
    expect(page.locator("#origin")).to_contain_text("forked from u-1 at ship")

    page.locator("#r-key").select_option("charge")
    page.get_by_label("New instance id").fill("u-2")  # taken: the server says so
    page.get_by_role("button", name="Fork from the same key").click()
    expect(page.get_by_role("alert")).to_contain_text("already exists")
