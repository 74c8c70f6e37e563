"""Paged listing of instances and the overview of a deployment, as plain values.

A page in ``order="id"`` lists instances in instance-id order (the state store's key
order), so a partition answers one from where the cursor points without reading the
rest, and pages of several partitions or workers merge into one (``merge_pages``). The
cursor is an instance id: the next page starts after it. A partition may stop early (it
looks at a bounded number of keys per call, so a rare filter never holds up its
processor); its cursor then says how far it got, and the merge never passes a
partition's cursor.

``order="newest"`` and ``"oldest"`` sort by created time. Each partition reads its page
from its index by that time (``consumers.created_listing``; a filter so rare that the
index does not fill the page within a budget reads every meta instead); their cursor
is ``<created_at>/<instance id>`` of the last row, so a page does not shift when
instances start meanwhile, and pages merge the same way.
``since`` and ``until`` bound the created time in every order. ``where`` keeps the
instances whose search attributes (``ctx.set_attributes``) equal each of its values
(``engine.api.attributes.same_value``; a list of values: any of them); on the query
string it is a JSON object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from stepstream.engine.api.attributes import AttributeValue, attribute_problem, same_value
from stepstream.engine.errors import InvalidPayload
from stepstream.engine.reads.views import InstanceStatus
from stepstream.engine.replay.state import Status

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
RECENT_FAILURES = 10
# A ``where`` value: one value, or a tuple of values any of which matches.
WhereValue = AttributeValue | tuple[AttributeValue, ...]
ORDERS = ("newest", "oldest", "id")
_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_instant(text: str, what: str, now: datetime | None = None) -> str:
    """``text`` as a created time to compare with ``InstanceStatus.created_at``: an ISO
    8601 time (UTC when it names no zone) or how long ago (``90s``, ``30m``, ``1h``,
    ``2d``, ``1w``). ``InvalidPayload`` naming ``what`` when it is neither."""
    text = text.strip()
    ago = _AGO.fullmatch(text)
    try:
        if ago is not None:
            seconds = float(ago.group(1)) * _UNIT_SECONDS[ago.group(2)]
            when = (now or datetime.now(UTC)) - timedelta(seconds=seconds)
        else:
            when = datetime.fromisoformat(text.replace("Z", "+00:00"))
            if when.tzinfo is None:
                when = when.replace(tzinfo=UTC)
        return when.astimezone(UTC).isoformat(timespec="milliseconds")
    except (ValueError, OverflowError):  # not a time, or not one between years 1 and 9999
        raise InvalidPayload(
            f"{what}={text!r} is not a time: give an ISO 8601 time such as "
            "2026-01-31T08:00:00Z, or how long ago, such as 90s, 30m, 1h, 2d or 1w"
        ) from None


STATUSES = tuple(s.value for s in Status)


def check_status(status: str | None) -> str | None:
    """``status`` if it is one an instance can have (or None: any)."""
    if status is not None and status not in STATUSES:
        raise InvalidPayload(f"unknown status {status!r}; use one of {', '.join(STATUSES)}")
    return status


@dataclass(frozen=True, slots=True)
class ListQuery:
    """Which instances a page holds: filters, where it starts, and how many."""

    status: str | None = None
    workflow: str | None = None
    prefix: str = ""
    # The page starts after this cursor (None: at the first): an instance id in id
    # order, else ``<created_at>/<instance id>``.
    after: str | None = None
    limit: int = DEFAULT_PAGE_SIZE
    order: str = "id"
    # Created at or after ``since`` and before ``until`` (as ``parse_instant`` writes).
    since: str | None = None
    until: str | None = None
    # Search attributes each instance must have, as (key, value) pairs (all of them; a
    # tuple of values: any of them).
    where: tuple[tuple[str, WhereValue], ...] = ()

    def matches(self, view: InstanceStatus) -> bool:
        return (
            (self.status is None or view.status == self.status)
            and (self.workflow is None or view.workflow == self.workflow)
            and view.instance_id.startswith(self.prefix)
            and (self.since is None or view.created_at >= self.since)
            and (self.until is None or view.created_at < self.until)
            and self.has_attributes(view.attributes)
        )

    def has_attributes(self, attributes: Mapping[str, Any]) -> bool:
        """Whether ``attributes`` hold every value of ``where``."""
        return all(
            k in attributes
            and (
                any(same_value(attributes[k], one) for one in v)
                if isinstance(v, tuple)
                else same_value(attributes[k], v)
            )
            for k, v in self.where
        )

    @property
    def by_id(self) -> bool:
        return self.order == "id"

    def position(self, view: InstanceStatus) -> str:
        """Where ``view`` sorts in this query's order, in the form of its cursor."""
        return view.instance_id if self.by_id else f"{view.created_at}/{view.instance_id}"

    @classmethod
    def from_params(cls, query: Mapping[str, str]) -> ListQuery:
        """The page a query string asks for (``status``, ``workflow``, ``prefix``,
        ``after``, ``limit``, ``order``, ``since``, ``until``, ``where``); ``InvalidPayload`` saying
        what is wrong."""
        status = check_status(query.get("status") or None)
        raw = query.get("limit") or str(DEFAULT_PAGE_SIZE)
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_PAGE_SIZE:
            raise InvalidPayload(f"limit={raw!r} is not a whole number from 1 to {MAX_PAGE_SIZE}")
        order = query.get("order") or "id"
        if order not in ORDERS:
            raise InvalidPayload(f"order={order!r} is not one of {', '.join(ORDERS)}")
        after = query.get("after") or None
        if after is not None and order != "id" and "/" not in after:
            raise InvalidPayload(
                f"after={after!r} is not a cursor of order={order} (CREATED/ID): pass the "
                "next cursor the previous page gave, or order=id for an instance id"
            )
        since, until = (query.get(name) or None for name in ("since", "until"))
        where = query.get("where") or None
        return cls(
            status=status,
            workflow=query.get("workflow") or None,
            prefix=query.get("prefix", ""),
            after=after,
            limit=int(raw),
            order=order,
            since=None if since is None else parse_instant(since, "since"),
            until=None if until is None else parse_instant(until, "until"),
            where=() if where is None else where_pairs(where),
        )

    def params(self) -> dict[str, str]:
        """As the query string of ``GET /v1/instances``."""
        out = {"limit": str(self.limit)}
        for name, value in (
            ("status", self.status),
            ("workflow", self.workflow),
            ("prefix", self.prefix or None),
            ("after", self.after),
            ("order", None if self.by_id else self.order),
            ("since", self.since),
            ("until", self.until),
            ("where", orjson.dumps(dict(self.where)).decode() if self.where else None),
        ):
            if value is not None:
                out[name] = value
        return out

    def resumed(self, after: str | None, limit: int) -> ListQuery:
        return replace(self, after=after, limit=limit)


class _Twice(ValueError):
    pass


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a key given twice (JSON keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Twice(
                f"where gives {key!r} twice; every key must match and an attribute has one "
                "value: give each key once (a list of values matches any of them)"
            )
        out[key] = value
    return out


def where_pairs(where: str | Mapping[str, Any]) -> tuple[tuple[str, WhereValue], ...]:
    """A ``where`` (a mapping, or its JSON object text from a query string) as the pairs
    of ``ListQuery.where``; ``InvalidPayload`` saying what is wrong."""
    if isinstance(where, str):
        try:
            where = json.loads(where, object_pairs_hook=_once_each)
        except (ValueError, RecursionError) as exc:  # nested too deep: RecursionError
            if isinstance(exc, _Twice):
                raise InvalidPayload(str(exc)) from None
            raise InvalidPayload(
                f"where is not valid JSON ({exc}): give the attributes to match as one JSON "
                'object, for example where={"customer":"42","vip":true}'
            ) from None
    if not isinstance(where, Mapping):
        raise InvalidPayload(
            f"where is not a JSON object but a {type(where).__name__}: give the attributes "
            'to match as one, for example where={"customer":"42","vip":true}'
        )
    pairs: list[tuple[str, WhereValue]] = []
    for key, value in where.items():
        if not isinstance(key, str):
            raise InvalidPayload(
                f"where has the key {key!r}, which is not text: an attribute key is text"
            )
        values = value if isinstance(value, list | tuple) else [value]
        bad = [v for v in values if not isinstance(v, str | int | float | bool)]
        if bad or not values:
            shown = f"a {type(bad[0]).__name__}" if bad else "an empty list"
            raise InvalidPayload(
                f"where {key!r}: {value!r} is {shown}; an attribute is matched by a "
                "str, int, float or bool (or a list of them: any of its values)"
            )
        # What no attribute can hold (an infinite number, a key with '='): none matches.
        problem = next(filter(None, (attribute_problem(key, v) for v in values)), None)
        if problem is not None:
            raise InvalidPayload(f"where: {problem} (no attribute can be so: none would match)")
        pairs.append((key, tuple(values) if isinstance(value, list | tuple) else value))
    return tuple(pairs)


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


def merge_pages(
    pages: Sequence[InstancePage], limit: int, query: ListQuery | None = None
) -> InstancePage:
    """One page of at most ``limit`` out of pages of disjoint sets of instances (the
    partitions of a worker, the workers of a deployment) that answered the same
    ``query`` (its order; default: id order)."""
    query = query or ListQuery()
    newest = query.order == "newest"
    frontiers = [p.next for p in pages if p.next is not None]
    # Past the least advanced cursor some source has not looked yet: nothing beyond it
    # is sure.
    frontier = (max if newest else min)(frontiers) if frontiers else None

    def before_frontier(v: InstanceStatus) -> bool:
        if frontier is None:
            return True
        at = query.position(v)
        return at >= frontier if newest else at <= frontier

    found = sorted(
        (v for p in pages for v in p.instances if before_frontier(v)),
        key=query.position,
        reverse=newest,
    )
    if len(found) > limit or (len(found) == limit and frontier is not None):
        found = found[:limit]
        return InstancePage(found, query.position(found[-1]))
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
