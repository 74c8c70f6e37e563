"""``merge_pages``: pages of disjoint sources, each cut short by its own budget, merge
into pages that together list every matching instance once, in id order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stepstream.engine.reads.listing import InstancePage, merge_pages
from stepstream.engine.reads.views import InstanceStatus


def _view(instance_id: str) -> InstanceStatus:
    return InstanceStatus(instance_id, "running", "w", "1", "", "")


def _source_page(
    ids: list[str], after: str | None, limit: int, budget: int, wanted: set[str]
) -> InstancePage:
    """What one partition answers: it looks at ids after the cursor, at most ``budget``
    of them, and stops at ``limit`` matches (``consumers.instance_store``'s contract)."""
    found: list[InstanceStatus] = []
    looked = 0
    for instance_id in sorted(ids):
        if after is not None and instance_id <= after:
            continue
        looked += 1
        if instance_id in wanted:
            found.append(_view(instance_id))
            if len(found) >= limit:
                return InstancePage(found, instance_id)
        if looked >= budget:
            return InstancePage(found, instance_id)
    return InstancePage(found, None)


@settings(max_examples=200, deadline=None)
@given(
    ids=st.sets(st.text("abc-0123", min_size=1, max_size=5), max_size=40),
    sources=st.integers(1, 4),
    limit=st.integers(1, 6),
    budget=st.integers(1, 8),
    keep=st.integers(1, 3),
)
def test_paging_lists_every_match_once_in_order(
    ids: set[str], sources: int, limit: int, budget: int, keep: int
) -> None:
    ordered = sorted(ids)
    split = [[i for n, i in enumerate(ordered) if n % sources == s] for s in range(sources)]
    wanted = {i for n, i in enumerate(ordered) if n % keep == 0}
    seen: list[str] = []
    after = None
    for _ in range(10 * len(ids) + 10):
        pages = [_source_page(part, after, limit, budget, wanted) for part in split]
        page = merge_pages(pages, limit)
        assert len(page.instances) <= limit
        seen += [v.instance_id for v in page.instances]
        if page.next is None:
            break
        assert after is None or page.next > after  # always moves on
        after = page.next
    assert seen == sorted(wanted)
