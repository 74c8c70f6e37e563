"""``merge_pages``: pages of disjoint sources, each cut short by its own budget, merge
into pages that together list every matching instance once, in id order, or by created
time; and the times a list may be bounded by."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepstream import InvalidPayload
from stepstream.engine.reads.listing import (
    InstancePage,
    ListQuery,
    merge_pages,
    parse_instant,
)
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


def _time_page(views: list[InstanceStatus], query: ListQuery) -> InstancePage:
    """What one partition answers in a time order (``consumers.instance_store``'s
    contract): its instances after the cursor, in order, at most ``limit``."""
    newest = query.order == "newest"
    after = query.after
    chosen = sorted(
        (
            v
            for v in views
            if after is None or (query.position(v) < after if newest else query.position(v) > after)
        ),
        key=query.position,
        reverse=newest,
    )
    if len(chosen) <= query.limit:
        return InstancePage(chosen, None)
    return InstancePage(chosen[: query.limit], query.position(chosen[query.limit - 1]))


@settings(max_examples=200, deadline=None)
@given(
    created=st.dictionaries(st.text("abc-0123", min_size=1, max_size=5), st.integers(0, 9)),
    sources=st.integers(1, 4),
    limit=st.integers(1, 6),
    order=st.sampled_from(["newest", "oldest"]),
)
def test_time_ordered_pages_merge_into_one_order(
    created: dict[str, int], sources: int, limit: int, order: str
) -> None:
    """Each source pages its own instances by created time; merged, the pages list
    every instance once, newest (or oldest) first, ties by id."""
    views = [
        InstanceStatus(i, "running", "w", "1", f"2026-01-01T00:00:0{t}.000+00:00", "")
        for i, t in created.items()
    ]
    split = [views[s::sources] for s in range(sources)]
    seen: list[str] = []
    after = None
    for _ in range(len(views) + 2):
        query = ListQuery(after=after, limit=limit, order=order)
        page = merge_pages([_time_page(part, query) for part in split], limit, query)
        seen += [v.instance_id for v in page.instances]
        if page.next is None:
            break
        after = page.next
    expected = sorted(views, key=lambda v: (v.created_at, v.instance_id))
    if order == "newest":
        expected.reverse()
    assert seen == [v.instance_id for v in expected]


def test_times_are_iso_or_how_long_ago() -> None:
    now = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    assert parse_instant("90m", "since", now) == "2026-03-01T10:30:00.000+00:00"
    assert parse_instant("1w", "since", now) == "2026-02-22T12:00:00.000+00:00"
    assert parse_instant("2026-03-01T08:00:00Z", "since") == "2026-03-01T08:00:00.000+00:00"
    assert parse_instant("2026-03-01T09:00:00+01:00", "x") == "2026-03-01T08:00:00.000+00:00"
    assert parse_instant("2026-03-01 08:00", "x") == "2026-03-01T08:00:00.000+00:00"
    with pytest.raises(InvalidPayload, match="until='later' is not a time"):
        parse_instant("later", "until")
