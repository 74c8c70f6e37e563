"""An embedded data directory opened read-only, for tools that only look (replay).

RocksDB's read-only mode takes no lock and writes nothing: the directory's owner (a
running ``stepstream dev``) keeps it, and what the reader sees is the data as of the open.
The writer's ``flock`` and the fencing epoch are left alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from rocksdict import AccessType, Options, Rdict

from stepstream.consumers import state_keys
from stepstream.consumers.embedded import keys
from stepstream.consumers.embedded.datadir import ROCKSDB_DIR
from stepstream.consumers.embedded.errors import StorageFailed
from stepstream.consumers.rocks import prefix_scan
from stepstream.engine.wire.topics import partition_for

_SEQ_SUFFIX = 1 + 8  # the separator after the instance id, and the sequence number


class ReadOnlyData:
    """Use as a context manager; iterate ``histories()`` before it closes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        rocks_dir = os.path.join(self.path, ROCKSDB_DIR)
        if os.path.isfile(os.path.join(self.path, "processes.json")):
            raise StorageFailed(
                f"{self.path} holds the partitions of several engine processes (`stepstream "
                f"dev --processes`), each in a directory of its own: pass "
                f"{os.path.join(self.path, 'process-0')}, then process-1 and so on"
            )
        if not os.path.isfile(os.path.join(rocks_dir, "CURRENT")):
            raise StorageFailed(
                f"{self.path} is not an embedded data directory (no {ROCKSDB_DIR}/CURRENT); "
                "pass the --data of stepstream dev"
            )
        options = Options(raw_mode=True)
        families = {name: Options(raw_mode=True) for name in keys.COLUMN_FAMILIES}
        try:
            self._db: Any = Rdict(
                rocks_dir,
                options,
                column_families=families,
                access_type=AccessType.read_only(),
            )
        except Exception as exc:
            raise StorageFailed(
                f"cannot open the embedded data directory {self.path} read-only: {exc}"
            ) from exc
        self._cfs = {name: self._db.get_column_family(name) for name in keys.COLUMN_FAMILIES}
        meta = self._cfs[keys.META_CF]
        stored_format = meta.get(keys.META_FORMAT)
        if stored_format is not None and keys.decode_u64(stored_format) != keys.FORMAT_VERSION:
            self.close()
            raise StorageFailed(
                f"{self.path} has embedded format {keys.decode_u64(stored_format)}; this "
                f"stepstream reads format {keys.FORMAT_VERSION}"
            )
        count = meta.get(keys.META_PARTITIONS)
        self.partitions = 0 if count is None else keys.decode_u64(count)

    def histories(self, instance_id: str | None = None) -> Iterator[tuple[str, list[bytes]]]:
        """(instance id, its history records as stored, in sequence order) of every
        instance the directory holds, or of ``instance_id`` alone."""
        state = self._cfs[keys.STATE_CF]
        if instance_id is not None:
            if not self.partitions:
                return
            base = keys.state_user_prefix(partition_for(instance_id, self.partitions))
            prefix = base + state_keys.history_prefix(instance_id)
            values = [value for _, value in prefix_scan(state, prefix)]
            if values:
                yield instance_id, values
            return
        for partition in range(self.partitions):
            prefix = keys.state_user_prefix(partition) + state_keys.HISTORY
            current: bytes | None = None
            values = []
            for key, value in prefix_scan(state, prefix):
                escaped = key[len(prefix) : -_SEQ_SUFFIX]
                if escaped != current:
                    if current is not None:
                        yield state_keys.unescape_id(current), values
                    current, values = escaped, []
                values.append(value)
            if current is not None:
                yield state_keys.unescape_id(current), values

    def close(self) -> None:
        for cf in self._cfs.values():
            cf.close()
        self._cfs.clear()
        if self._db is not None:
            self._db.close()
            self._db = None

    def __enter__(self) -> ReadOnlyData:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
