"""Paged listing of instances and the overview of a deployment, as plain values.

A page lists instances in instance-id order (the state store's key order), so a
partition answers one from where the cursor points without reading the rest, and
pages of several partitions or workers merge into one (``merge_pages``). The cursor is
an instance id: the next page starts after it. A partition may stop early (it looks at
a bounded number of keys per call, so a rare filter never holds up its processor); its
cursor then says how far it got, and the merge never passes a partition's cursor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stepstream.engine.errors import InvalidPayload
from stepstream.engine.reads.views import InstanceStatus
from stepstream.engine.replay.state import Status

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
RECENT_FAILURES = 10


@dataclass(frozen=True, slots=True)
class ListQuery:
    """Which instances a page holds: filters, where it starts, and how many."""

    status: str | None = None
    workflow: str | None = None
    prefix: str = ""
    # The page starts after this instance id (None: at the first).
    after: str | None = None
    limit: int = DEFAULT_PAGE_SIZE

    def matches(self, view: InstanceStatus) -> bool:
        return (
            (self.status is None or view.status == self.status)
            and (self.workflow is None or view.workflow == self.workflow)
            and view.instance_id.startswith(self.prefix)
        )

    @classmethod
    def from_params(cls, query: Mapping[str, str]) -> ListQuery:
        """The page a query string asks for (``status``, ``workflow``, ``prefix``,
        ``after``, ``limit``); ``InvalidPayload`` saying what is wrong."""
        status = query.get("status") or None
        statuses = [s.value for s in Status]
        if status is not None and status not in statuses:
            raise InvalidPayload(f"unknown status {status!r}; use one of {', '.join(statuses)}")
        raw = query.get("limit") or str(DEFAULT_PAGE_SIZE)
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_PAGE_SIZE:
            raise InvalidPayload(f"limit={raw!r} is not a whole number from 1 to {MAX_PAGE_SIZE}")
        return cls(
            status=status,
            workflow=query.get("workflow") or None,
            prefix=query.get("prefix", ""),
            after=query.get("after") or None,
            limit=int(raw),
        )

    def params(self) -> dict[str, str]:
        """As the query string of ``GET /v1/instances``."""
        out = {"limit": str(self.limit)}
        for name, value in (
            ("status", self.status),
            ("workflow", self.workflow),
            ("prefix", self.prefix or None),
            ("after", self.after),
        ):
            if value is not None:
                out[name] = value
        return out

    def resumed(self, after: str | None, limit: int) -> ListQuery:
        return replace(self, after=after, limit=limit)


@dataclass(frozen=True, slots=True)
class InstancePage:
    """Instances in id order; ``next`` is the cursor of the following page (every
    instance up to it was considered), None when there is nothing after them. A page
    lists no waits: the status of one instance has them."""

    instances: list[InstanceStatus]
    next: str | None

    def to_json(self) -> dict[str, Any]:
        return {"instances": [i.to_json() for i in self.instances], "next": self.next}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> InstancePage:
        instances = [InstanceStatus.from_json(i) for i in raw.get("instances", [])]
        return cls(instances, raw.get("next"))


def merge_pages(pages: Sequence[InstancePage], limit: int) -> InstancePage:
    """One page of at most ``limit`` out of pages of disjoint sets of instances (the
    partitions of a worker, the workers of a deployment) that answered the same query."""
    frontiers = [p.next for p in pages if p.next is not None]
    # Past the least cursor some source has not looked yet: nothing beyond it is sure.
    frontier = min(frontiers) if frontiers else None
    found = sorted(
        (v for p in pages for v in p.instances if frontier is None or v.instance_id <= frontier),
        key=lambda v: v.instance_id,
    )
    if len(found) > limit or (len(found) == limit and frontier is not None):
        found = found[:limit]
        return InstancePage(found, found[-1].instance_id)
    return InstancePage(found, frontier)


@dataclass(frozen=True, slots=True)
class Overview:
    """Counts by status, what finished in the last hour, and the latest failures."""

    counts: dict[str, int] = field(default_factory=dict)
    finished_last_hour: dict[str, int] = field(default_factory=dict)
    # Newest first, at most RECENT_FAILURES.
    recent_failures: list[InstanceStatus] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "counts": self.counts,
            "finished_last_hour": self.finished_last_hour,
            "recent_failures": [f.to_json() for f in self.recent_failures],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Overview:
        return cls(
            dict(raw.get("counts", {})),
            dict(raw.get("finished_last_hour", {})),
            [InstanceStatus.from_json(f) for f in raw.get("recent_failures", [])],
        )


def merge_overviews(parts: Sequence[Overview]) -> Overview:
    counts: dict[str, int] = {}
    finished: dict[str, int] = {}
    for part in parts:
        for status, n in part.counts.items():
            counts[status] = counts.get(status, 0) + n
        for status, n in part.finished_last_hour.items():
            finished[status] = finished.get(status, 0) + n
    failures = sorted(
        (f for part in parts for f in part.recent_failures),
        key=lambda f: (f.updated_at, f.instance_id),
        reverse=True,
    )
    return Overview(counts, finished, failures[:RECENT_FAILURES])
