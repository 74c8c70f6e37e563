"""The docs hold together: every relative link of README.md and docs/*.md names a file
that exists, the README links every page of docs/, and the README stays short (the
manuals live in docs/, one page a topic)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 220

# [text](target) and ![alt](target), outside code; the target up to a space or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def _links(page: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    return LINK.findall(text)


def _relative(target: str) -> str | None:
    """The file a link names, or None for an external link or an anchor of the page."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return None
    return target.split("#", 1)[0]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_names_a_file_that_exists(page: Path) -> None:
    dead = []
    for target in _links(page):
        path = _relative(target)
        if path is None:
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.exists():
            dead.append(target)
    assert not dead, f"{page.relative_to(REPO)} links to files that do not exist: {dead}"


def test_the_readme_links_every_docs_page() -> None:
    linked = {_relative(t) for t in _links(REPO / "README.md")}
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert pages - linked == set(), "README.md does not link these pages"


def test_the_readme_stays_short() -> None:
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines: move the manual part into a page of docs/"
    )
