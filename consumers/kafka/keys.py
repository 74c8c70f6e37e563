"""Every reserved name of the Kafka backend, in one place: the layout of a partition's
RocksDB, the files of a state directory, the record headers stepstream adds, and the
consumer group's name.

A partition's RocksDB has two column families:

- ``state``: the engine's keys (``consumers.state_keys``), as the engine wrote them.
- ``meta``: what this state covers: the next offset of each topic kind it has consumed
  (``offset/<kind>``), the highest fencing epoch folded into it (``epoch``), a checksum of
  the last history record it covers, the partition count and layout version it was made
  with.

Offsets and epochs are big-endian unsigned 64-bit integers.
"""

from __future__ import annotations

import struct

STATE_CF = "state"
META_CF = "meta"
COLUMN_FAMILIES = (STATE_CF, META_CF)

# Bump (with a migration) when a layout here changes.
FORMAT_VERSION = 1
META_FORMAT = b"format"
META_PARTITIONS = b"partitions"
META_EPOCH = b"epoch"
# CRC-32 of the last history record the state covers: a restore checks that the history
# topic still holds that record where the state says, and discards the state if not (the
# topics were recreated, or the broker lost them).
META_HISTORY_TAIL = b"history-tail"
# The history offset of the last snapshot of this partition taken or loaded here.
META_SNAPSHOT_HISTORY = b"snapshot-history"
META_SNAPSHOT_ENTRIES = b"snapshot-entries"  # key/value pairs that snapshot held
META_SNAPSHOT_TIMERS = b"snapshot-timers"  # the timers offset of a snapshot loaded here
META_SNAPSHOT_OFFSET = b"snapshot-offset"  # where that snapshot's SnapshotTaken is
_META_OFFSET = b"offset/"

# Files under ``<state dir>/<topic prefix>/``.
LOCK_FILE = "worker.lock"
WORKER_ID_FILE = "worker-id"

# On the last history record of a commit that consumed commands: "<epoch>:<next commands
# offset>", so a worker restoring a partition without local state resumes the commands
# topic exactly where the history it folded ends.
HEADER_OFFSETS = "stepstream.offsets"


def group_id(prefix: str) -> str:
    """The consumer group of the workers of one topic prefix."""
    return f"{prefix}.workers"


def sources_group_id(prefix: str) -> str:
    """The consumer group that reads the user topics declared as ``Source``s."""
    return f"{prefix}.sources"


def partition_dir(partition: int) -> str:
    return f"partition-{partition}"


def offset_key(kind: str) -> bytes:
    return _META_OFFSET + kind.encode()


_U64 = struct.Struct(">Q")


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def decode_u64(data: bytes) -> int:
    return int(_U64.unpack(data)[0])


def encode_offsets_header(epoch: int, commands_offset: int) -> bytes:
    return f"{epoch}:{commands_offset}".encode()


def decode_offsets_header(data: bytes) -> tuple[int, int] | None:
    """(epoch, next commands offset), or None if the header is not ours to read."""
    epoch, sep, offset = data.partition(b":")
    if not sep or not epoch.isdigit() or not offset.isdigit():
        return None
    return int(epoch), int(offset)
