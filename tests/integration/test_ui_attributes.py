"""The web UI's attribute filter and an instance's search attributes, in a real headless
Chromium: typed as ``key=value`` pairs, matched as ``stepstream list --where`` matches."""

from __future__ import annotations

import time
from pathlib import Path

from playwright.sync_api import Browser, expect

from tests.browser import browser  # noqa: F401  (the fixture)
from tests.dev_server import start_dev
from tests.integration.test_web_ui import call, start

expect.set_options(timeout=20_000)


def test_the_list_filters_by_attributes_and_the_instance_shows_them(
    browser: Browser,  # noqa: F811
    tmp_path: Path,
) -> None:
    server = start_dev(tmp_path, "attr_flows", "from tests.workflows import tagged  # noqa: F401\n")
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        start(server, "tagged", "a-1", {"customer": "42", "vip": True})
        start(server, "tagged", "a-2", {"customer": 42, "amount": 25.0})
        start(server, "tagged", "a-3", {"customer": "7"})
        start(server, "tagged", "a-4", {"name": "Smith, John"})
        for _ in range(400):
            listed = call(
                server, "GET", "/v1/instances?where=%7B%22name%22%3A%22Smith%2C%20John%22%7D"
            )
            if listed["instances"]:
                break
            time.sleep(0.05)

        page.goto(f"{server.url}/ui#/")
        expect(page.locator("#instances tbody tr")).to_have_count(4)
        page.get_by_role("textbox", name="Attributes").fill("customer=42")
        page.get_by_role("button", name="Filter").click()
        rows = page.locator("#instances tbody tr")
        expect(rows).to_have_count(2)  # the number and the same text
        assert sorted(page.locator("#instances tbody td:first-child").all_inner_texts()) == [
            "a-1",
            "a-2",
        ]
        page.get_by_role("textbox", name="Attributes").fill('customer="42", vip=true')
        page.get_by_role("button", name="Filter").click()
        expect(rows).to_have_count(1)
        expect(rows.first.locator("td.attrs")).to_have_text('customer="42", vip=true')
        page.screenshot(path=str(tmp_path / "list-attributes.png"), full_page=True)

        page.get_by_role("textbox", name="Attributes").fill("customer")
        page.get_by_role("button", name="Filter").click()
        expect(page.locator("#attrs-error")).to_contain_text('"customer" is not KEY=VALUE')
        page.get_by_role("textbox", name="Attributes").fill("customer=42, customer=7")
        page.get_by_role("button", name="Filter").click()
        expect(page.locator("#attrs-error")).to_contain_text("customer is given twice")

        # Text with a comma is quoted, so the filter reads it as one value.
        page.goto(f"{server.url}/ui#/i/a-4")
        page.locator("#attributes").get_by_role("link", name="name").click()
        expect(page.get_by_role("textbox", name="Attributes")).to_have_value('name="Smith, John"')
        expect(rows).to_have_count(1)
        expect(rows.first.locator("td.attrs")).to_have_text('name="Smith, John"')

        page.goto(f"{server.url}/ui#/i/a-2")
        table = page.locator("#attributes")
        expect(table).to_contain_text("amount")
        expect(table.locator("tr")).to_have_count(2)
        # Each key links to the list filtered by its value (a number: also the same text).
        table.get_by_role("link", name="customer").click()
        expect(rows).to_have_count(2)  # the list page, filtered
        expect(page.get_by_role("textbox", name="Attributes")).to_have_value("customer=42")
        assert errors == [], f"script errors in the page: {errors}"
    finally:
        context.close()
        server.stop()
