"""How fast the web UI's instance list is with many instances: not a test, a measurement.

    python -m tests.ui_scale --n 100000 [--data DIR]

1. Makes ``--n`` instances through the embedded engine, in this process, with the
   ``Client`` (``tests.ui_workflows``: 60 % wait for an event, 39 % complete at once, 1 %
   fail), unless ``--data`` already holds them.
2. Serves them with ``stepstream dev`` and opens ``/ui`` in headless Chromium: the time
   from navigation to the first page of the list shown (newest first, the default), and
   from pressing Filter to the filtered list shown (marks the page sets:
   ``stepstream:list-shown``, ``stepstream:filter-sent``), each the median of a few runs.
3. Times the API calls under them, and the old unpaged ``GET /v1/instances`` beside them.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from stepstream.engine.api.workflow import Registry
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.producers.client import Client
from tests.browser import chromium_path
from tests.dev_server import DevServer, clean_env
from tests.processes import first_line

RUNS = 5


async def make_instances(data: Path, n: int) -> float:
    registry = Registry()
    registry.add_module("tests.ui_workflows")
    engine = await open_embedded(registry, EmbeddedConfig(data_dir=str(data), partitions=4))
    started = time.perf_counter()
    async with Client(engine.make_transport(owns_engine=True)) as client:
        batch = 500
        for low in range(0, n, batch):
            calls = []
            for i in range(low, min(n, low + batch)):
                instance_id = f"order-{i:06d}"
                if i % 100 < 60:
                    calls.append(client.start("gate", None, instance_id=instance_id))
                else:
                    calls.append(client.start("instant", i % 100 == 99, instance_id=instance_id))
            await asyncio.gather(*calls)
    return time.perf_counter() - started


def _get_ms(url: str) -> float:
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=600) as response:
            response.read()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 1)


def measure_browser(url: str) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    first, filtered = [], []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path())
        for _ in range(RUNS):
            # The page's CSP refuses eval, which wait_for_function uses.
            page = browser.new_page(bypass_csp=True)
            page.goto(f"{url}/ui#/")
            page.locator("#instances tbody tr").first.wait_for()
            first.append(
                page.evaluate("performance.getEntriesByName('stepstream:list-shown')[0].startTime")
            )
            page.get_by_label("Status", exact=True).select_option("failed")
            page.get_by_role("button", name="Filter").click()
            page.wait_for_function(
                "performance.getEntriesByName('stepstream:list-shown').length == 2"
            )
            filtered.append(
                page.evaluate(
                    "performance.getEntriesByName('stepstream:list-shown')[1].startTime"
                    " - performance.getEntriesByName('stepstream:filter-sent')[0].startTime"
                )
            )
            page.close()
        browser.close()
    return {
        "list_first_paint_ms": round(statistics.median(first), 1),
        "filter_status_failed_paint_ms": round(statistics.median(filtered), 1),
    }


def _serve(root: Path) -> DevServer:
    """``stepstream dev`` on the data made: resuming tens of thousands of waiting
    instances takes longer than the tests' helper waits for."""
    (root / "scale_flows.py").write_text("from tests.ui_workflows import *  # noqa\n")
    log = root / "dev.log"
    command = ["dev", "--workflows", "scale_flows", "--data", str(root / "data"), "--port", "0"]
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepstream.ops.cli", *command],
            cwd=root,
            env=clean_env(root),
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    found = re.search(r"listening on (https?://\S+)", first_line(proc, 600))
    if found is None:
        proc.kill()
        raise SystemExit(f"stepstream dev did not start:\n{log.read_text()}")
    return DevServer(found.group(1), root, log, proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--data", help="a data directory made by an earlier run")
    args = parser.parse_args()
    root = Path(args.data or tempfile.mkdtemp(prefix="stepstream-ui-scale-"))
    report: dict[str, Any] = {"instances": args.n}
    if not (root / "data").exists():
        report["create_s"] = round(asyncio.run(make_instances(root / "data", args.n)), 1)
    server = _serve(root)
    try:
        report.update(measure_browser(server.url))
        api = f"{server.url}/v1/instances"
        report["api_ms"] = {
            "page_50": _get_ms(f"{api}?limit=50"),
            "page_50_newest": _get_ms(f"{api}?limit=50&order=newest"),
            "page_50_newest_since_1h": _get_ms(f"{api}?limit=50&order=newest&since=1h"),
            "page_50_after_cursor": _get_ms(f"{api}?limit=50&after=order-050000"),
            "status_failed": _get_ms(f"{api}?limit=50&status=failed"),
            "workflow_instant": _get_ms(f"{api}?limit=50&workflow=instant"),
            "prefix_order-0777": _get_ms(f"{api}?limit=50&prefix=order-0777"),
            "overview": _get_ms(f"{server.url}/v1/overview"),
            "unpaged_list_old": _get_ms(api),
        }
    finally:
        server.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
