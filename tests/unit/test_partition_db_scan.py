"""A partition's prefix scans are bounded above inside RocksDB; they still give exactly
the keys that start with the prefix, from ``start`` on, in key order, whatever bytes the
prefix ends with (0xff included, where the bound carries into an earlier byte)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from stepstream.consumers.kafka.db import PartitionDB

_BYTES = st.sampled_from([b"\x00", b"a", b"b", b"\xfe", b"\xff"])
_KEYS = st.lists(st.lists(_BYTES, min_size=1, max_size=4).map(b"".join), max_size=30)
_PREFIX = st.lists(_BYTES, max_size=3).map(b"".join)


@settings(max_examples=60, deadline=None)
@given(keys=_KEYS, prefix=_PREFIX, start=st.one_of(st.none(), _PREFIX))
def test_a_scan_gives_every_key_with_the_prefix_and_no_other(
    keys: list[bytes], prefix: bytes, start: bytes | None
) -> None:
    with tempfile.TemporaryDirectory() as path:
        db = PartitionDB.open(path, 0, 1)
        try:
            db.write(puts=[(key, key) for key in keys])
            begin = prefix if start is None else prefix + start
            expected = sorted(k for k in set(keys) if k.startswith(prefix) and k >= begin)
            assert [k for k, _ in db.scan(prefix, begin)] == expected
        finally:
            db.close()


def test_a_scan_read_across_writes_gives_every_key(tmp_path: Path) -> None:
    # The bound lives in memory the iterator reads as it goes: a scan taken a record at a
    # time while the processor writes and allocates must still see all of its keys.
    db = PartitionDB.open(str(tmp_path), 0, 1)
    try:
        db.write(puts=[(b"h\x00i-%d\x00%d" % (i, s), b"x") for i in range(30) for s in range(4)])
        scan = db.scan(b"h\x00i-1\x00")
        first = next(scan)
        for n in range(20):
            db.write(puts=[(b"h\x00i-2\x00%d" % (n + 4), bytes(64) * n)])
        assert [first[0], *(key for key, _ in scan)] == [b"h\x00i-1\x00%d" % s for s in range(4)]
    finally:
        db.close()


# Prefixes as an instance's state has them: none begins another.
_PREFIXES = st.lists(_PREFIX.map(lambda p: p + b"\x00\x00"), max_size=6).filter(
    lambda ps: not any(a != b and b.startswith(a) for a in ps for b in ps)
)


@settings(max_examples=60, deadline=None)
@given(keys=_KEYS, prefixes=_PREFIXES)
def test_scans_of_many_prefixes_read_together_give_what_each_scan_gives(
    keys: list[bytes], prefixes: list[bytes]
) -> None:
    # Loading many evicted instances at once reads their prefixes in one iterator pass,
    # in any order asked (a prefix asked twice included), and their keys in one multi-get.
    keys = keys + [p + k for p in prefixes for k in keys[:3]]
    with tempfile.TemporaryDirectory() as path:
        db = PartitionDB.open(path, 0, 1)
        try:
            db.write(puts=[(key, key + b"v") for key in keys])
            assert db.scan_many(prefixes) == [list(db.scan(p)) for p in prefixes]
            asked = [*prefixes, b"missing", *keys[:5]]
            assert db.get_many(asked) == [db.get(k) for k in asked]
        finally:
            db.close()
