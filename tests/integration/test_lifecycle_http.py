"""Start policies, a run's timeout and terminate through `stepstream dev`: the CLI with
``--json``, the raw HTTP API, the ``http://`` client and the web UI's Terminate button."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect

from stepstream import Client, InstanceExists, WorkflowTerminated, WorkflowTimeout
from tests.browser import browser  # noqa: F401  (the fixture)
from tests.dev_server import DevServer, start_dev

WORKFLOWS = "from tests.lifecycle_workflows import deadline, flaky_once  # noqa: F401\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    dev = start_dev(tmp_path_factory.mktemp("lifecycle"), "lifecycle_flows", WORKFLOWS)
    yield dev
    dev.stop()


def call(server: DevServer, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(server.url + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as refused:
        with refused:
            return refused.code, json.loads(refused.read())


def cli_json(server: DevServer, *args: str, code: int = 0) -> Any:
    done = server.cli(*args, "--json")
    assert done.returncode == code, f"stepstream {' '.join(args)}: {done.stderr}{done.stdout}"
    assert "Traceback" not in done.stderr, done.stderr
    return json.loads(done.stdout) if done.stdout.strip() else None


def status_of(server: DevServer, instance_id: str, want: str, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        status = cli_json(server, "status", instance_id)
        if status["status"] == want or time.monotonic() > deadline:
            assert status["status"] == want, status
            return status
        time.sleep(0.1)


def test_cli_start_if_exists(server: DevServer) -> None:
    assert cli_json(server, "start", "flaky-once", "--id", "c-1", "--input", '{"fail": true}') == {
        "instance_id": "c-1"
    }
    status_of(server, "c-1", "failed")
    done = server.cli("start", "flaky-once", "--id", "c-1", "--if-exists", "fail")
    assert done.returncode == 1
    assert done.stderr.startswith("error: "), done.stderr
    assert "c-1 already exists (status failed)" in done.stderr
    assert "restart_if_failed" in done.stderr  # says what to do next
    assert "--if-exists of the CLI" in done.stderr  # and how, whichever way it was started

    # The default returns the existing one; a restart runs it again.
    assert cli_json(server, "start", "flaky-once", "--id", "c-1") == {"instance_id": "c-1"}
    assert status_of(server, "c-1", "failed")["run"] == 1
    answer = cli_json(
        server,
        "start",
        "flaky-once",
        "--id",
        "c-1",
        "--input",
        '{"n": 5}',
        "--if-exists",
        "restart_if_failed",
        "--wait",
    )
    assert answer == {"instance_id": "c-1", "status": "completed", "result": {"ok": 5}}
    assert cli_json(server, "status", "c-1")["run"] == 2
    types = [h["type"] for h in cli_json(server, "history", "c-1")]
    assert types.count("WorkflowStarted") == 2 and "WorkflowRestarted" in types

    bad = server.cli("start", "flaky-once", "--id", "c-2", "--if-exists", "replace")
    assert bad.returncode == 2 and "invalid choice: 'replace'" in bad.stderr


def test_cli_terminate(server: DevServer) -> None:
    cli_json(server, "start", "flaky-once", "--id", "t-1", "--input", '{"wait": true}')
    status_of(server, "t-1", "running")
    done = cli_json(server, "terminate", "t-1", "--reason", "stuck")
    assert done == {"instance_id": "t-1", "command": "terminate", "reason": "stuck"}
    status = status_of(server, "t-1", "terminated")
    assert status["error"] == "terminated: stuck"
    listed = [i["instance_id"] for i in cli_json(server, "list", "--status", "terminated")]
    assert "t-1" in listed
    result = cli_json(server, "result", "t-1", code=1)
    assert result["status"] == "terminated"
    assert result["error"]["type"] == "WorkflowTerminated"

    again = server.cli("terminate", "t-1", "--json")
    assert again.returncode == 1
    assert "t-1 is already terminated" in again.stderr
    help_text = server.cli("terminate", "--help").stdout
    assert "no compensation" in help_text and "--reason" in help_text


def test_cli_result_of_a_timed_out_run(server: DevServer) -> None:
    cli_json(server, "start", "deadline", "--id", "d-1", "--input", '{"wait": true}')
    result = cli_json(server, "result", "d-1", "--timeout", "20", code=1)
    assert result["status"] == "failed"
    assert result["error"]["type"] == "WorkflowTimeout"
    assert cli_json(server, "status", "d-1")["error"].startswith("WorkflowTimeout: ")


def test_http_api(server: DevServer) -> None:
    body = {"workflow": "flaky-once", "instance_id": "h-1", "input": {"wait": True}}
    assert call(server, "POST", "/v1/instances", body) == (201, {"instance_id": "h-1"})
    code, refused = call(server, "POST", "/v1/instances", {**body, "if_exists": "fail"})
    assert code == 409
    assert refused["error"]["type"] == "InstanceExists"
    assert refused["error"]["instance_id"] == "h-1"
    assert refused["error"]["status"] in ("pending", "running")
    code, bad = call(server, "POST", "/v1/instances", {**body, "if_exists": 3})
    assert code == 400 and bad["error"]["type"] == "InvalidPayload"

    assert call(server, "POST", "/v1/instances/h-1/terminate", {"reason": "api"})[0] == 202
    status_of(server, "h-1", "terminated")
    code, finished = call(server, "POST", "/v1/instances/h-1/terminate", {})
    assert (code, finished["error"]["type"]) == (409, "InstanceFinished")
    code, result = call(server, "GET", "/v1/instances/h-1/result?timeout=5")
    assert (code, result["error"]["type"]) == (422, "WorkflowTerminated")

    restarted = {**body, "input": {"n": 2}, "if_exists": "restart_if_failed"}
    assert call(server, "POST", "/v1/instances", restarted)[0] == 201
    assert status_of(server, "h-1", "completed")["run"] == 2


async def test_http_client(server: DevServer) -> None:
    async with Client.connect(server.url) as client:
        await client.start("flaky-once", {"wait": True}, instance_id="hc-1")
        with pytest.raises(InstanceExists, match="hc-1 already exists"):
            await client.start("flaky-once", None, instance_id="hc-1", if_exists="fail")
        await client.terminate("hc-1", reason="client")
        with pytest.raises(WorkflowTerminated, match="client"):
            await client.result("hc-1", timeout=10)
        await client.start("deadline", {"wait": True}, instance_id="hc-2")
        with pytest.raises(WorkflowTimeout):
            await client.result("hc-2", timeout=20)


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:  # noqa: F811
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    yield opened
    context.close()
    assert errors == [], f"script errors in the page: {errors}"


def test_ui_terminate_button(server: DevServer, page: Page) -> None:
    expect.set_options(timeout=20_000)
    call(
        server,
        "POST",
        "/v1/instances",
        {"workflow": "flaky-once", "instance_id": "u-1", "input": {"wait": True}},
    )
    page.goto(f"{server.url}/ui#/i/u-1")
    badge = page.locator(".meta .badge")
    expect(badge).to_have_text("running")
    page.get_by_label("Reason").fill("from the UI")
    page.get_by_role("button", name="Terminate").click()
    expect(badge).to_have_text("terminated")
    expect(page.locator("#instance-error")).to_contain_text("from the UI")
    # A finished instance cannot be terminated: the button says why (the server refuses
    # it too: test_http_api).
    terminate = page.get_by_role("button", name="Terminate")
    expect(terminate).to_be_disabled()
    expect(terminate).to_have_attribute("title", re.compile("it has finished \\(terminated\\)"))
