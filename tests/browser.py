"""A headless Chromium for the web UI's tests: Debian's package (``apt-get install -y
chromium``, which ``.ci/run`` does), driven by Playwright for Python. Playwright's own
browser downloads are never used, so the tests need nothing from the internet."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, sync_playwright


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found is not None:
            return found
    pytest.fail(
        "the web UI tests need Chromium and found neither `chromium` nor `chromium-browser` "
        "on PATH: install it with `apt-get install -y chromium` (Debian; .ci/run does this)"
    )


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium_path())
        try:
            yield launched
        finally:
            launched.close()
