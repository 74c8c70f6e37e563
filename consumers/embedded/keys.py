"""Every reserved name and key layout of the embedded backend's RocksDB, in one place.

Column families:

- ``log``: the durable log. Key = kind code (1 byte) + partition (>I) + offset (>Q), so one
  topic partition is one contiguous, offset-ordered key range. Value = varint length of
  the record key + record key + record value.
- ``state``: per-partition state. Key = partition (>I) + namespace (1 byte) + rest, so a
  partition never sees another's keys and user keys never collide with reserved ones:
  ``u`` + user key for the engine's state, ``o`` + kind code for committed offsets,
  ``f`` + source process (>I) for the next offset expected from another engine process
  forwarding commands to this partition (``consumers/embedded/forwarding.py``).
- ``meta``: facts about the data directory itself (partition count, fencing epoch).
"""

from __future__ import annotations

import struct

from stepstream.engine.wire.topics import COMMANDS, DEAD_LETTERS, HISTORY, TIMERS
from stepstream.engine.wire.uvarint import uvarint

LOG_CF = "log"
STATE_CF = "state"
META_CF = "meta"
COLUMN_FAMILIES = (LOG_CF, STATE_CF, META_CF)

# The on-disk layout version; bump it (with a migration) when a key layout changes.
FORMAT_VERSION = 1
META_FORMAT = b"format"
META_PARTITIONS = b"partitions"
META_EPOCH = b"epoch"

# Persisted in every log and offset key: never renumber, only add.
KIND_CODES: dict[str, int] = {COMMANDS: 1, HISTORY: 2, TIMERS: 3, DEAD_LETTERS: 4}

_STATE_USER = b"u"
_STATE_OFFSET = b"o"
_STATE_FORWARD = b"f"

_PARTITION = struct.Struct(">I")
_OFFSET = struct.Struct(">Q")
_LOG_KEY = struct.Struct(">BIQ")


def kind_code(kind: str) -> int:
    try:
        return KIND_CODES[kind]
    except KeyError:
        known = ", ".join(KIND_CODES)
        raise ValueError(f"unknown topic kind {kind!r}; the embedded log has {known}") from None


def log_key(kind: str, partition: int, offset: int) -> bytes:
    return _LOG_KEY.pack(kind_code(kind), partition, offset)


def log_offset(key: bytes) -> int:
    return int(_LOG_KEY.unpack(key)[2])


def log_partition_prefix(kind: str, partition: int) -> bytes:
    """The prefix shared by every record of one topic partition."""
    return log_key(kind, partition, 0)[: -_OFFSET.size]


def encode_record(key: bytes, value: bytes) -> bytes:
    return uvarint(len(key)) + key + value


def decode_record(data: bytes) -> tuple[bytes, bytes]:
    length, start = _read_varint(data)
    end = start + length
    return data[start:end], data[end:]


def state_user_prefix(partition: int) -> bytes:
    return _PARTITION.pack(partition) + _STATE_USER


def state_offset_key(partition: int, kind: str) -> bytes:
    return _PARTITION.pack(partition) + _STATE_OFFSET + bytes((kind_code(kind),))


def state_forward_key(partition: int, source: int) -> bytes:
    return _PARTITION.pack(partition) + _STATE_FORWARD + _PARTITION.pack(source)


def encode_u64(value: int) -> bytes:
    """Offsets and epochs."""
    return _OFFSET.pack(value)


def decode_u64(data: bytes) -> int:
    return int(_OFFSET.unpack(data)[0])


def _read_varint(data: bytes) -> tuple[int, int]:
    """Return (value, index of the first byte after it)."""
    value = 0
    shift = 0
    for index, byte in enumerate(data):
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index + 1
        shift += 7
    raise ValueError("truncated log record: the key length varint runs past the value")
