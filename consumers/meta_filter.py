"""What a listing reads off an instance's stored meta (compact JSON, ``meta_json``) without
decoding it into a state: whether it can match a query's filters, its status and its
created time. A rare status, workflow or attribute then costs a byte search per meta."""

from __future__ import annotations

from collections.abc import Callable

import orjson

from stepstream.engine.reads.listing import ListQuery, WhereValue

_STATUS_MARK = b'"st":"'  # how the status sits in an instance's meta (compact JSON)
_CREATED_MARK = b',"c":'  # and its created time

# Whether a meta's instance passes a query's status, workflow and attribute filters.
MetaFilter = Callable[[bytes], bool]


def marks(query: ListQuery) -> list[bytes]:
    """Bytes a meta of an instance of ``query`` must contain (compact JSON): a meta
    without one of them is not looked at further. Empty when the query has no filter
    on what a meta holds (status, workflow, attributes)."""
    found = []
    if query.status is not None:
        found.append(_STATUS_MARK + query.status.encode() + b'"')
    if query.workflow is not None:
        found.append(b'"w":' + orjson.dumps(query.workflow))
    found.extend(_attribute_mark(key, value) for key, value in query.where)
    return found


def meta_filter(query: ListQuery) -> MetaFilter | None:
    """Whether a meta passes ``query``'s status, workflow and attribute filters (None:
    the query has none, every meta passes). Its bytes are searched for the marks
    first; only a meta holding them all is parsed."""
    needed = marks(query)
    if not needed:
        return None

    def passes(meta: bytes) -> bool:
        if not all(mark in meta for mark in needed):
            return False  # a rare status or attribute: most metas are never parsed
        raw = orjson.loads(meta)
        return not (
            (query.status is not None and raw["st"] != query.status)
            or (query.workflow is not None and raw["w"] != query.workflow)
            or (query.where and not query.has_attributes(raw.get("at", {})))
        )

    return passes


def _attribute_mark(key: str, value: WhereValue) -> bytes:
    """Bytes every meta holding attribute ``key`` = ``value`` contains (compact JSON):
    the key with the value when it is text or a bool, else the key alone (25 and 25.0
    are written differently and match each other; a tuple matches any of several)."""
    mark = orjson.dumps(key) + b":"
    return mark + orjson.dumps(value) if isinstance(value, str | bool) else mark


def created_in(meta: bytes) -> int:
    """The created time (ms) in a meta's compact JSON, without parsing the rest: the
    workflow, version and status come before it, and no JSON text can hold the
    unescaped quotes of its key."""
    at = meta.index(_CREATED_MARK) + len(_CREATED_MARK)
    return int(meta[at : meta.index(b",", at)])


def status_in(meta: bytes) -> str:
    at = meta.index(_STATUS_MARK) + len(_STATUS_MARK)
    return meta[at : meta.index(b'"', at)].decode()
