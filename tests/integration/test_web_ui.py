"""The web UI at /ui of `stepstream dev`, in a real headless Chromium: the instance list
(filters, paging, narrow screens), an instance page (timeline, history, live updates),
each control with its bad-input errors, the definitions page, keyboard use and the API
token. Instances are made through the HTTP API, as any client would."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.browser import browser  # noqa: F401  (the fixture)
from tests.dev_server import DevServer, clean_env, start_dev

WORKFLOWS = "from tests.ui_workflows import gate, leaf, tour  # noqa: F401\n"
TOKEN = "ui-test-token-4711"
# Generous: a loaded CI machine may be slow to apply a command; nothing here is timed.
expect.set_options(timeout=20_000)


def call(server: DevServer, method: str, path: str, body: Any = None, **headers: str) -> Any:
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        headers.setdefault("Content-Type", "application/json")
    request = urllib.request.Request(server.url + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as refused:
        refused.close()  # the error is also the response: its socket goes with it
        raise


def start(server: DevServer, workflow: str, instance_id: str, value: Any = None, **h: str) -> None:
    body = {"workflow": workflow, "instance_id": instance_id, "input": value}
    call(server, "POST", "/v1/instances", body, **h)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    """Gates g-01..g-12 waiting for "go", of which g-01, g-02 completed and g-03 failed."""
    dev = start_dev(tmp_path_factory.mktemp("ui"), "ui_flows", WORKFLOWS)
    try:
        for n in range(1, 13):
            start(dev, "gate", f"g-{n:02d}", {"n": n})
        for instance_id, payload in (("g-01", 1), ("g-02", 2), ("g-03", {"fail": "no"})):
            call(
                dev,
                "POST",
                f"/v1/instances/{instance_id}/events",
                {"name": "go", "payload": payload},
            )
        for instance_id in ("g-01", "g-02", "g-03"):
            try:
                call(dev, "GET", f"/v1/instances/{instance_id}/result?timeout=30")
            except urllib.error.HTTPError:
                pass  # g-03 fails, as meant
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


def ids(page: Page) -> list[str]:
    return page.locator("#instances tbody tr td:first-child").all_inner_texts()


def test_list_filters_and_pages(server: DevServer, page: Page) -> None:
    page.goto(f"{server.url}/ui#/?limit=5&order=id")
    expect(page.locator("#instances tbody tr")).to_have_count(5)
    expect(page.get_by_label("Sort")).to_have_value("id")
    assert ids(page) == ["g-01", "g-02", "g-03", "g-04", "g-05"]
    row = page.locator("#instances tbody tr").nth(2)
    expect(row).to_contain_text("failed")
    expect(row).to_contain_text("told to fail: no")
    expect(row).to_contain_text("gate")
    page.get_by_role("link", name="Next page").click()
    expect(page.locator("#instances tbody td:first-child").first).to_have_text("g-06")
    assert ids(page) == ["g-06", "g-07", "g-08", "g-09", "g-10"]
    page.get_by_role("link", name="First page").click()
    expect(page.locator("#instances tbody td:first-child").first).to_have_text("g-01")

    page.get_by_label("Status", exact=True).select_option("completed")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#instances tbody tr")).to_have_count(2)
    assert ids(page) == ["g-01", "g-02"]
    page.get_by_label("Status", exact=True).select_option("")
    page.get_by_label("Id starts with").fill("g-1")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#instances tbody tr")).to_have_count(3)
    assert ids(page) == ["g-10", "g-11", "g-12"]
    page.get_by_label("Id starts with").fill("")
    page.get_by_label("Workflow", exact=True).fill("nothing-like-it")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#instances caption")).to_have_text("No instances match")

    # Readable on a phone: the page itself never scrolls sideways (a table may, inside).
    page.set_viewport_size({"width": 360, "height": 800})
    page.goto(f"{server.url}/ui#/")
    expect(page.locator("#instances tbody tr").first).to_be_visible()
    assert page.evaluate("document.documentElement.scrollWidth") <= 360


def test_instance_page_shows_timeline_history_and_updates_live(
    server: DevServer, page: Page
) -> None:
    start(server, "tour", "t-live", {"who": "me"})
    page.goto(f"{server.url}/ui#/i/t-live")
    waiting = page.locator('.tl-row[data-kind="wait"][data-outcome="waiting"]')
    expect(waiting).to_contain_text("approval")  # the tour ends waiting for approval
    retried = page.locator('.tl-row[data-kind="step"]', has_text="flaky")
    expect(retried).to_have_count(1)  # its two attempts on one line
    expect(retried.locator(".tl-attempt")).to_have_count(2)
    expect(retried.locator('.tl-attempt[data-outcome="retry"]')).to_have_count(1)
    expect(retried.locator(".tl-backoff")).to_have_count(1)
    expect(page.locator('.tl-row[data-kind="child"]')).to_contain_text("t-live/leaf")
    expect(page.locator('.tl-row[data-kind="compensation"]')).to_contain_text("trip/hotel/undo")
    expect(page.locator('.tl-row[data-kind="sleep"]')).to_contain_text("elapsed")
    expect(page.locator('.tl-row[data-kind="step"][data-outcome="failed"]')).to_contain_text(
        "trip/pay"
    )
    expect(page.locator("#waits")).to_contain_text("approval")
    expect(page.locator("#input")).to_contain_text('who: "me"')
    expect(page.locator("#result")).to_have_text("(not finished)")
    history = page.locator("#history")
    expect(history).to_contain_text("WorkflowStarted")
    expect(history).to_contain_text("card declined by the issuer")

    # Sent by someone else: the open page shows it without a reload.
    call(server, "POST", "/v1/instances/t-live/events", {"name": "approval", "payload": "yes"})
    expect(page.locator(".meta .badge")).to_have_text("completed")
    expect(page.locator("#result")).to_contain_text('approval: "yes"')
    expect(history).to_contain_text("WorkflowCompleted")

    page.get_by_role("link", name="t-live/leaf").click()
    expect(page.locator("h1")).to_have_text("t-live/leaf")
    expect(page.locator("#result")).to_have_text("42")

    page.goto(f"{server.url}/ui#/i/no-such-thing")
    expect(page.get_by_role("alert")).to_contain_text("UnknownInstance")
    expect(page.get_by_role("alert")).to_contain_text("no instance 'no-such-thing'")


def test_controls_and_their_errors(server: DevServer, page: Page) -> None:
    start(server, "gate", "c-1")
    page.goto(f"{server.url}/ui#/i/c-1")
    badge = page.locator(".meta .badge")
    alert = page.get_by_role("alert")
    expect(badge).to_have_text("running")
    page.get_by_role("button", name="Pause").click()
    expect(badge).to_have_text("paused")
    page.get_by_role("button", name="Resume").click()
    expect(badge).to_have_text("running")
    expect(page.locator(".notice")).to_have_text("Resume sent.")

    page.get_by_label("Event name").fill("go")
    page.get_by_label("Payload (JSON)").fill("{bad json")
    page.get_by_role("button", name="Send event").click()
    expect(alert).to_contain_text("The payload is not valid JSON")
    expect(page.get_by_label("Payload (JSON)")).to_be_focused()
    history = call(server, "GET", "/v1/instances/c-1/history")["history"]
    assert "EventBuffered" not in [e["type"] for e in history]  # nothing was sent

    page.get_by_label("Event name").fill("")
    page.get_by_label("Payload (JSON)").fill("")
    page.get_by_role("button", name="Send event").click()
    expect(alert).to_contain_text("Give the event a name")

    page.get_by_label("Event name").fill("~sneaky")
    page.get_by_role("button", name="Send event").click()
    expect(alert).to_contain_text("InvalidPayload")
    expect(alert).to_contain_text("reserved for the engine's own events")

    page.get_by_label("Event name").fill("later")
    page.get_by_role("button", name="Send event").click()
    expect(page.locator(".notice")).to_contain_text("nothing waits for it now")

    page.get_by_label("Event name").fill("go")
    page.get_by_label("Payload (JSON)").fill('{"x": [1, 2]}')
    page.get_by_role("button", name="Send event").click()
    expect(badge).to_have_text("completed")
    expect(page.locator("#result")).to_contain_text("x: [2 items]")
    # Finished: nothing more to do, and each control says why.
    cancel = page.get_by_role("button", name="Cancel instance")
    expect(cancel).to_be_disabled()
    expect(cancel).to_have_attribute("title", re.compile("it has finished \\(completed\\)"))

    start(server, "gate", "c-2")
    page.goto(f"{server.url}/ui#/i/c-2")
    expect(badge).to_have_text("running")  # c-2's page is drawn: the form is its own now
    page.get_by_label("Reason").fill("no longer needed")
    page.get_by_role("button", name="Cancel instance").click()
    expect(badge).to_have_text("cancelled")
    expect(page.locator("#instance-error")).to_contain_text("no longer needed")


def test_definitions_show_workflows_and_overview(server: DevServer, page: Page) -> None:
    page.goto(f"{server.url}/ui#/definitions")
    workflows = page.locator("#workflows")
    for name in ("gate", "leaf", "tour"):
        expect(workflows).to_contain_text(name)
    failed = page.locator("#counts div").filter(has_text="failed")
    expect(failed.locator("dd")).not_to_have_text("0")
    expect(page.locator("#failures")).to_contain_text("g-03")
    expect(page.locator("#throughput")).to_contain_text("completed")
    page.get_by_role("link", name="instances of gate").click()
    expect(page.get_by_label("Workflow", exact=True)).to_have_value("gate")


def test_usable_with_the_keyboard(server: DevServer, page: Page) -> None:
    page.goto(f"{server.url}/ui#/?order=id")
    expect(page.locator("#instances tbody tr").first).to_be_visible()
    page.keyboard.press("Tab")
    expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
    for _ in range(60):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.textContent") == "g-05":
            break
    focused = page.locator(":focus")
    expect(focused).to_have_text("g-05")
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none"
    page.keyboard.press("Enter")
    expect(page.locator("h1")).to_have_text("g-05")
    expect(page.locator("h1")).to_be_focused()
    page.keyboard.press("Tab")  # the first control after the heading
    expect(page.get_by_role("button", name="Pause")).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator(".meta .badge")).to_have_text("paused")


def test_the_token_is_asked_for_and_sent(tmp_path: Path, browser: Browser) -> None:  # noqa: F811
    root = tmp_path / "secured"
    root.mkdir()
    env = clean_env(root, STEPSTREAM_API_TOKEN=TOKEN)
    server = start_dev(root, "ui_flows", WORKFLOWS, env=env)
    try:
        start(server, "gate", "tok-1", Authorization=f"Bearer {TOKEN}")
        context = browser.new_context()
        page = context.new_page()
        page.goto(f"{server.url}/ui")
        expect(page.locator("h1")).to_have_text("API token needed")
        page.get_by_label("API token").fill("not-the-token")
        page.get_by_role("button", name="Use token").click()
        expect(page.locator(".token-form")).to_contain_text("not this server's")
        page.get_by_label("API token").fill(TOKEN)
        page.get_by_role("button", name="Use token").click()
        expect(page.locator("#instances")).to_contain_text("tok-1")
        # The controls' requests pass the API's guards (token, Origin, JSON body).
        page.get_by_role("link", name="tok-1").click()
        page.get_by_role("button", name="Pause").click()
        expect(page.locator(".meta .badge")).to_have_text("paused")
        context.close()

        # A link may carry the token in its fragment, which never reaches the server.
        context = browser.new_context()
        page = context.new_page()
        page.goto(f"{server.url}/ui#token={TOKEN}")
        expect(page.locator("#instances")).to_contain_text("tok-1")
        assert "token" not in page.url
        context.close()

        with pytest.raises(urllib.error.HTTPError) as refused:
            call(server, "GET", "/ui/api/instances")
        assert refused.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as cross_site:
            call(
                server,
                "POST",
                "/ui/api/instances/tok-1/cancel",
                {},
                Authorization=f"Bearer {TOKEN}",
                Origin="http://elsewhere.example",
            )
        assert cross_site.value.code == 403
    finally:
        server.stop()
