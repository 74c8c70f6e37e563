"""One page of a partition's instances newest (or oldest) first by created time.

From the index by created time (``s\\0<created:8><id>``, kept by ``write_state``), a page
costs its own keys and the metas of its candidates, whatever the partition holds: the
time range and the cursor are where the index is read from and to, the id prefix is
checked on the key, and the metas are read together. A filter on what metas hold
(status, workflow, attributes) is checked on the candidates' metas, up to ``BUDGET``
keys: a filter so rare that the page would not be full by then (as the first chunk of
candidates shows), or a prefix that few ids have, is answered by reading every meta
under the prefix instead (``page_from_metas``, the way before the index), so it costs
little more than that: a chunk of candidates per partition. A store whose
index is not built yet (no ``STARTED_INDEXED``: written by an older version, before its
owner resumed it) is read that way too.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

from stepstream.consumers import state_keys as keys
from stepstream.consumers.meta_filter import created_in, meta_filter
from stepstream.engine.errors import InvalidPayload
from stepstream.engine.reads.listing import InstancePage, ListQuery
from stepstream.engine.reads.views import InstanceStatus
from stepstream.engine.replay.state_json import state_from_storage
from stepstream.engine.seams import StateStore

# Index keys a page looks at before it gives the index up for a read of every meta: a
# few ms, against 3 us a meta for the whole partition.
BUDGET = 4096
# Candidates whose metas are read in one multi-get when a filter may drop some of them.
_CHUNK = 256
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_KEY_ID = len(keys.STARTED) + 8  # where the escaped id begins in an index key


def page_by_created(store: StateStore, query: ListQuery) -> InstancePage:
    """The instances of ``query`` (order ``newest`` or ``oldest``) on the partition whose
    state is ``store``, from its cursor on."""
    if store.get(keys.STARTED_INDEXED) is not None:
        page = page_from_index(store, query, BUDGET)
        if page is not None:
            return page
    return page_from_metas(store, query)


def page_from_index(store: StateStore, query: ListQuery, budget: int) -> InstancePage | None:
    """The page read from the index by created time, or None if it takes more than
    ``budget`` keys (a rare filter or prefix)."""
    newest = query.order == "newest"
    low = keys.STARTED if query.since is None else keys.started(_ms_of(query.since), "")
    high = None if query.until is None else keys.started(_ms_of(query.until), "")
    if query.after is not None:
        at = keys.started(*_position_of(query.after))
        if newest:
            high = at if high is None else min(high, at)
        else:
            low = max(low, at + b"\x00")  # escaped ids hold no 0x00: the next key after
    walk = store.scan_reverse(keys.STARTED, high) if newest else store.scan(keys.STARTED, low)
    scope = keys.escape_id(query.prefix)
    passes = meta_filter(query)
    want = query.limit + 1  # one more than the page: whether a next page exists
    found: list[InstanceStatus] = []
    chunk: list[bytes] = []

    def take() -> None:
        metas = store.get_many([keys.META + key[_KEY_ID:] for key in chunk])
        for key, meta in zip(chunk, metas, strict=True):
            # A key whose instance is gone or started again since is not its key (kept
            # true by every write; checked, as the meta is read anyway).
            if meta is None or created_in(meta) != keys.split_started(key)[0]:
                continue
            if passes is None or passes(meta):
                instance_id = keys.unescape_id(key[_KEY_ID:])
                found.append(InstanceStatus.of(state_from_storage(instance_id, meta, [])))
                if len(found) == want:
                    break
        chunk.clear()

    looked = 0
    for key, _ in walk:
        if (key < low) if newest else (high is not None and key >= high):
            break
        looked += 1
        if looked > budget:
            return None
        if not key.startswith(scope, _KEY_ID):
            continue
        chunk.append(key)
        if len(chunk) >= (_CHUNK if passes is not None else want - len(found)):
            take()
            if len(found) == want:
                break
            # At the rate the filter has matched so far (at least one in what was read),
            # the page would take more keys than the budget: read the metas at once.
            if passes is not None and looked * want > budget * max(len(found), 1):
                return None
    if chunk:
        take()
    views = found[: query.limit]
    more = len(found) > query.limit
    return InstancePage(views, query.position(views[-1]) if more else None)


def page_from_metas(store: StateStore, query: ListQuery) -> InstancePage:
    """The page read from every meta under the prefix, without the index: a meta is
    parsed only to check a filter its raw bytes have passed, never to sort (its created
    time is read off the bytes), and just the page's instances are decoded."""
    newest = query.order == "newest"
    passes = meta_filter(query)
    since = None if query.since is None else _ms_of(query.since)
    until = None if query.until is None else _ms_of(query.until)
    after = None if query.after is None else _position_of(query.after)

    def candidates() -> Iterator[tuple[tuple[int, str], bytes]]:
        for key, meta in store.scan(keys.META + keys.escape_id(query.prefix)):
            if passes is not None and not passes(meta):
                continue
            created = created_in(meta)
            if (since is not None and created < since) or (until is not None and created >= until):
                continue
            # Sorts as the cursor's text ``<created_at>/<id>`` does.
            position = (created, keys.split_meta(key))
            if after is not None and (position >= after if newest else position <= after):
                continue
            yield position, meta

    pick = heapq.nlargest if newest else heapq.nsmallest
    chosen = pick(query.limit + 1, candidates())
    views = [
        InstanceStatus.of(state_from_storage(instance_id, meta, []))
        for (_, instance_id), meta in chosen[: query.limit]
    ]
    more = len(chosen) > query.limit
    return InstancePage(views, query.position(views[-1]) if more else None)


def _ms_of(instant: str) -> int:
    """A time as ``parse_instant`` and ``created_iso`` write it (ISO 8601 with ms), in
    ms: whole ms compare as their text does. Times before 1970 are 1970: no instance
    started earlier, and the index keys hold no negative time."""
    when = datetime.fromisoformat(instant)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0, (when - _EPOCH) // timedelta(milliseconds=1))


def _position_of(cursor: str) -> tuple[int, str]:
    """A ``<created_at>/<instance id>`` cursor as a (ms, id) position (ids may hold
    ``/``, created times never do)."""
    created, _, instance_id = cursor.partition("/")
    try:
        return _ms_of(created), instance_id
    except ValueError:
        raise InvalidPayload(
            f"after={cursor!r} is not a cursor of this order: pass the `next` of the "
            "page before, or no `after` for the first page"
        ) from None
