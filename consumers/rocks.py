"""RocksDB helpers shared by the backends that keep state in RocksDB (rocksdict)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def prefix_scan(
    column: Any, prefix: bytes, start: bytes | None = None
) -> Iterator[tuple[bytes, bytes]]:
    """Keys of ``column`` (an Rdict or column family) that start with ``prefix``, from
    ``start`` (default: the prefix) on, in key order. Exhaust or drop the iterator: a
    live one keeps RocksDB open."""
    it = column.iter()
    it.seek(prefix if start is None else start)
    while it.valid():
        key: bytes = it.key()
        if not key.startswith(prefix):
            return
        value: bytes = it.value()
        yield key, value
        it.next()
