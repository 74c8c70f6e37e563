"""What operators asked of the web UI, in a real headless Chromium: the list newest first
with a sort and a time range, controls that fit the instance's status, one timeline line
per step with its attempts on it, failures with their tracebacks, JSON as collapsible
trees, and dark mode. Each test saves screenshots under its pytest tmp dir and checks
elements, text, counts and computed colours (never pixels)."""

from __future__ import annotations

import re
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.browser import browser  # noqa: F401  (the fixture)
from tests.dev_server import DevServer, start_dev
from tests.integration.test_web_ui import call, start

WORKFLOWS = "from tests.ui_workflows import gate, leaf, stubborn, tour  # noqa: F401\n"
BULK = [f"bulk-{n}" for n in range(1, 12)]
LIGHT_BG, DARK_BG = "rgb(255, 255, 255)", "rgb(13, 17, 23)"
expect.set_options(timeout=20_000)


def _wait_status(server: DevServer, instance_id: str, *statuses: str) -> None:
    for _ in range(400):
        try:
            if call(server, "GET", f"/v1/instances/{instance_id}")["status"] in statuses:
                return
        except urllib.error.HTTPError:
            pass  # not started yet
        time.sleep(0.05)
    raise AssertionError(f"{instance_id} never reached {statuses}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    """bulk-1..bulk-11 started one after the other (waiting for "go"), s-1 retrying a
    step four times, f-1 failed by its workflow code."""
    dev = start_dev(tmp_path_factory.mktemp("ops-ui"), "ops_flows", WORKFLOWS)
    try:
        for instance_id in BULK:
            start(dev, "gate", instance_id)
            _wait_status(dev, instance_id, "running")
            time.sleep(0.005)  # each in its own millisecond
        start(dev, "stubborn", "s-1")
        start(dev, "gate", "f-1", {"order": {"lines": [{"sku": "a-1", "qty": 2}]}})
        call(dev, "POST", "/v1/instances/f-1/events", {"name": "go", "payload": {"fail": "x"}})
        _wait_status(dev, "s-1", "completed")
        _wait_status(dev, "f-1", "failed")
        yield dev
    finally:
        dev.stop()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:  # noqa: F811
    context = browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme="light")
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    yield opened
    context.close()
    assert errors == [], f"script errors in the page: {errors}"


def shot(page: Page, path: Path) -> None:
    """A full-page screenshot, checked to be a PNG of the page's width."""
    page.screenshot(path=str(path), full_page=True)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(data[16:20], "big") == page.viewport_size["width"]  # type: ignore[index]


def ids(page: Page) -> list[str]:
    return page.locator("#instances tbody tr td:first-child").all_inner_texts()


def test_the_list_is_newest_first_with_sort_and_time_range(
    server: DevServer, page: Page, tmp_path: Path
) -> None:
    page.goto(f"{server.url}/ui#/?prefix=bulk-")
    expect(page.locator("#instances tbody tr")).to_have_count(len(BULK))
    assert ids(page) == BULK[::-1]  # newest first, not bulk-1, bulk-10, bulk-11, bulk-2...
    expect(page.get_by_label("Sort")).to_have_value("newest")
    expect(page.locator("#instances thead")).to_contain_text("Started")
    shot(page, tmp_path / "list-newest.png")

    page.get_by_label("Sort").select_option("oldest")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#instances tbody td:first-child").first).to_have_text("bulk-1")
    assert ids(page) == BULK
    assert "order=oldest" in page.url

    # A window of start times (as a link would carry it): bulk-4 up to before bulk-8.
    listed = call(server, "GET", "/v1/instances?prefix=bulk-&order=oldest&limit=50")
    created = {i["instance_id"]: i["created_at"] for i in listed["instances"]}
    since, until = quote(created["bulk-4"]), quote(created["bulk-8"])
    page.goto(f"{server.url}/ui#/?prefix=bulk-&since={since}&until={until}")
    expect(page.locator("#instances tbody tr")).to_have_count(4)
    assert ids(page) == ["bulk-7", "bulk-6", "bulk-5", "bulk-4"]
    expect(page.get_by_label("Started since")).not_to_have_value("")
    shot(page, tmp_path / "list-window.png")

    # Nothing started in the future; everything in the last hour.
    page.goto(f"{server.url}/ui#/?prefix=bulk-")
    # Shown first: a form filled while the page still draws would be drawn over.
    expect(page.locator("#instances caption")).to_have_text(f"{len(BULK)} instances")
    page.get_by_label("Started since").fill("2999-01-01T00:00:00")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#instances caption")).to_have_text("No instances match")
    page.goto(f"{server.url}/ui#/?prefix=bulk-")
    page.get_by_role("link", name="last hour").click()
    expect(page.get_by_role("link", name="last hour")).to_have_attribute("aria-current", "true")
    expect(page.locator("#instances tbody tr")).to_have_count(len(BULK))
    assert "since=1h" in page.url

    # Pages follow the order: the second page of newest-first goes on from the first.
    page.goto(f"{server.url}/ui#/?prefix=bulk-&limit=4")
    expect(page.locator("#instances tbody tr")).to_have_count(4)
    page.get_by_role("link", name="Next page").click()
    expect(page.locator("#instances tbody td:first-child").first).to_have_text("bulk-7")
    assert ids(page) == ["bulk-7", "bulk-6", "bulk-5", "bulk-4"]


def test_controls_fit_the_status_and_say_why_not(
    server: DevServer, page: Page, tmp_path: Path
) -> None:
    start(server, "gate", "ctl-1")
    page.goto(f"{server.url}/ui#/i/ctl-1")
    badge = page.locator(".meta .badge")
    pause, resume = page.locator("#c-pause"), page.locator("#c-resume")
    cancel, send = page.locator("#c-cancel"), page.locator("#c-events")
    expect(badge).to_have_text("running")
    expect(pause).to_be_enabled()
    expect(resume).to_be_disabled()
    expect(resume).to_have_attribute("title", "Resume works on paused instances; it is running.")
    expect(cancel).to_be_enabled()
    expect(send).to_be_enabled()

    pause.click()
    expect(badge).to_have_text("paused")
    expect(resume).to_be_enabled()
    expect(pause).to_be_disabled()
    expect(pause).to_have_attribute(
        "title", "Pause works on pending or running instances; it is paused."
    )
    expect(send).to_be_enabled()  # kept until it resumes
    shot(page, tmp_path / "controls-paused.png")

    page.get_by_label("Reason").fill("not needed")
    cancel.click()
    expect(badge).to_have_text("cancelled")
    for control in (pause, resume, cancel, send):
        expect(control).to_be_disabled()
    expect(cancel).to_have_attribute(
        "title",
        "Cancel instance works on pending, running or paused instances; "
        "it has finished (cancelled).",
    )
    expect(page.get_by_label("Event name")).to_be_disabled()
    expect(page.get_by_label("Reason")).to_be_disabled()
    shot(page, tmp_path / "controls-finished.png")


def test_one_timeline_line_per_step_with_its_attempts(
    server: DevServer, page: Page, tmp_path: Path
) -> None:
    page.goto(f"{server.url}/ui#/i/s-1")
    steps = page.locator('.tl-row[data-kind="step"]')
    expect(steps).to_have_count(2)  # "call" (5 attempts) and "refuse" (1)
    call_row = steps.filter(has_text="call")
    expect(call_row).to_have_attribute("data-outcome", "ok")
    expect(call_row.locator(".tl-attempt")).to_have_count(5)
    expect(call_row.locator('.tl-attempt[data-outcome="retry"]')).to_have_count(4)
    expect(call_row.locator(".tl-backoff")).to_have_count(4)
    expect(call_row.locator(".tl-outcome")).to_contain_text("5 attempts")
    first = call_row.locator(".tl-attempt").first
    expect(first).to_have_attribute("title", re.compile("^attempt 1: step call · retry"))
    expect(first).to_have_attribute("title", re.compile("upstream refused attempt 1"))

    details = page.locator(".tl-details").first
    expect(details).to_be_hidden()
    call_row.get_by_role("button").click()  # the step's name
    expect(details).to_be_visible()
    expect(details.locator("tbody tr")).to_have_count(5)
    expect(details.locator("tbody tr").nth(3)).to_contain_text("upstream refused attempt 4")
    expect(details.locator("tbody tr").nth(4)).to_contain_text("ok")
    shot(page, tmp_path / "timeline-attempts.png")
    call_row.locator(".tl-attempt").nth(2).click()  # a bar closes it again
    expect(details).to_be_hidden()


def test_failures_show_tracebacks_and_json_is_a_tree(
    server: DevServer, page: Page, tmp_path: Path
) -> None:
    page.goto(f"{server.url}/ui#/i/s-1")
    failures = page.locator("#failures > li")
    expect(failures).to_have_count(5)  # four retried attempts and the refused step
    refused = failures.filter(has_text="card declined by the issuer")
    expect(refused).to_contain_text("NonRetryableError")
    expect(refused).to_contain_text("step refuse, attempt 1")
    expect(refused).to_contain_text("failed for good")
    expect(failures.first).to_contain_text("retried at")
    trace = refused.locator("pre.traceback")
    expect(trace).to_be_hidden()
    refused.locator("summary").click()
    expect(trace).to_be_visible()
    expect(trace).to_contain_text("Traceback (most recent call last)")
    expect(trace).to_contain_text('raise NonRetryableError("card declined by the issuer")')
    expect(trace).to_contain_text("NonRetryableError: card declined by the issuer")

    page.goto(f"{server.url}/ui#/i/f-1")
    error = page.locator("#instance-error")
    expect(error).to_contain_text("told to fail: x")
    error.locator("summary", has_text="Traceback").click()
    expect(error.locator("pre.traceback")).to_contain_text(", in gate")
    expect(error.locator("pre.traceback")).to_contain_text(
        "raise NonRetryableError(f\"told to fail: {payload['fail']}\")"
    )

    # The input as a tree: open two levels deep, each level collapsible.
    tree = page.locator("#input")
    expect(tree).to_contain_text("order: {1 key}")
    lines = tree.locator("details").nth(2)  # input > order > lines
    expect(lines.locator("> summary")).to_have_text("[1 item]")
    expect(lines.locator("> ul")).to_be_hidden()  # the third level starts closed
    lines.locator("> summary").click()
    expect(lines.locator("> ul")).to_be_visible()
    expect(lines).to_contain_text('sku: "a-1"')
    expect(tree.locator(".j-num")).to_have_text("2")
    tree.locator("details").first.locator("> summary").click()
    expect(tree.locator("details").first.locator("> ul")).to_be_hidden()
    # History attributes are trees too, not JSON strings.
    started = page.locator("#history tbody tr").filter(has_text="WorkflowStarted")
    expect(started.locator(".json-tree .j-key").first).to_be_visible()
    expect(started).to_contain_text('workflow: "gate"')
    shot(page, tmp_path / "failed-instance.png")


def _background(page: Page) -> str:
    return str(page.evaluate("getComputedStyle(document.documentElement).backgroundColor"))


def test_dark_mode_follows_the_system_and_the_toggle_is_remembered(
    browser: Browser,  # noqa: F811
    server: DevServer,
    tmp_path: Path,
) -> None:
    dark = browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme="dark")
    page = dark.new_page()
    page.goto(f"{server.url}/ui#/i/s-1")
    toggle = page.get_by_role("button", name="Light mode")
    expect(toggle).to_have_attribute("aria-pressed", "true")
    expect(page.locator(".tl-row").first).to_be_visible()
    assert _background(page) == DARK_BG
    text = page.evaluate("getComputedStyle(document.querySelector('h1')).color")
    assert text == "rgb(230, 237, 243)"
    shot(page, tmp_path / "dark.png")

    toggle.click()
    assert _background(page) == LIGHT_BG
    expect(page.get_by_role("button", name="Dark mode")).to_have_attribute("aria-pressed", "false")
    page.reload()  # remembered in this browser, over the system's preference
    expect(page.get_by_role("button", name="Dark mode")).to_be_visible()
    assert _background(page) == LIGHT_BG
    assert page.evaluate("localStorage.getItem('stepstream-theme')") == "light"
    shot(page, tmp_path / "light-by-choice.png")
    dark.close()

    light = browser.new_context(viewport={"width": 1280, "height": 900}, color_scheme="light")
    page = light.new_page()
    page.goto(f"{server.url}/ui#/")
    expect(page.locator("#instances tbody tr").first).to_be_visible()
    assert _background(page) == LIGHT_BG
    page.get_by_role("button", name="Dark mode").click()
    assert _background(page) == DARK_BG
    badge = page.locator(".badge-failed").first
    assert badge.evaluate("e => getComputedStyle(e).color") == "rgb(248, 81, 73)"
    light.close()
