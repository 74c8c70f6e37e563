"""The example tests under examples/ (not in the default test paths) pass as shown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_example_tests_of_the_order_workflow_pass() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "examples/test_order.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 passed" in run.stdout, run.stdout


def test_the_testing_page_links_the_example_test_and_the_export_format() -> None:
    page = (REPO / "docs" / "testing.md").read_text()
    assert "(../examples/test_order.py)" in page
    assert "(history-export.md)" in page
    assert (REPO / "examples" / "test_order.py").is_file()
    assert (REPO / "docs" / "history-export.md").is_file()
