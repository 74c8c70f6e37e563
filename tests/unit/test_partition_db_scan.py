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
