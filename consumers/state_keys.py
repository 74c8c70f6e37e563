"""Every reserved key of a partition's state store, in one place.

Layout (all keys local to one partition):
  m\\0<instance>              instance meta (engine.state JSON)
  e\\0<instance>\\0<key>       one entry per replay key
  h\\0<instance>\\0<seq:8>     the instance's history records, Avro single-object encoded
  a\\0<instance>              index of unfinished instances (loaded on restore)
  c\\0<instance>\\0<command>   a client command applied to the instance (duplicates skipped)
  f\\0<finished:8><instance>  finished instances by when they finished (retention)
  l\\0<time:8>               the history log's end offset at that time (log trimming)
  v\\0finished-indexed        set once every finished instance is in the f\\0 index
  t\\0<fire_at:8><timer_id>   timer index ordered by fire time -> instance id
  T\\0<timer_id>              timer id -> fire time (to cancel)
"""

from __future__ import annotations

import struct

META = b"m\x00"
ENTRY = b"e\x00"
HISTORY = b"h\x00"
ACTIVE = b"a\x00"
COMMAND = b"c\x00"
FINISHED = b"f\x00"
LOG_MARK = b"l\x00"
FINISHED_INDEXED = b"v\x00finished-indexed"
TIMER = b"t\x00"
TIMER_BY_ID = b"T\x00"
_SEQ = struct.Struct(">Q")


def meta(instance_id: str) -> bytes:
    return META + instance_id.encode()


def entry_prefix(instance_id: str) -> bytes:
    return ENTRY + instance_id.encode() + b"\x00"


def entry(instance_id: str, key: str) -> bytes:
    return entry_prefix(instance_id) + key.encode()


def history_prefix(instance_id: str) -> bytes:
    return HISTORY + instance_id.encode() + b"\x00"


def history(instance_id: str, seq: int) -> bytes:
    return history_prefix(instance_id) + _SEQ.pack(seq)


def instance_prefixes(instance_id: str) -> tuple[bytes, ...]:
    """The prefixes of every multi-key family one instance has (entries, history,
    applied commands); its single keys are ``meta``, ``active`` and ``finished``."""
    return (entry_prefix(instance_id), history_prefix(instance_id), command_prefix(instance_id))


def active(instance_id: str) -> bytes:
    return ACTIVE + instance_id.encode()


def command_prefix(instance_id: str) -> bytes:
    return COMMAND + instance_id.encode() + b"\x00"


def command(instance_id: str, command_id: str) -> bytes:
    return command_prefix(instance_id) + command_id.encode()


def finished(finished_ms: int, instance_id: str) -> bytes:
    return FINISHED + _SEQ.pack(finished_ms) + instance_id.encode()


def split_finished(key: bytes) -> tuple[int, str]:
    body = key[len(FINISHED) :]
    return _SEQ.unpack(body[:8])[0], body[8:].decode()


def log_mark(time_ms: int) -> bytes:
    return LOG_MARK + _SEQ.pack(time_ms)


def split_log_mark(key: bytes) -> int:
    return int(_SEQ.unpack(key[len(LOG_MARK) :])[0])


def encode_offset(offset: int) -> bytes:
    return _SEQ.pack(offset)


def decode_offset(raw: bytes) -> int:
    return int(_SEQ.unpack(raw)[0])


def timer(fire_at_ms: int, timer_id: str) -> bytes:
    return TIMER + _SEQ.pack(fire_at_ms) + timer_id.encode()


def timer_by_id(timer_id: str) -> bytes:
    return TIMER_BY_ID + timer_id.encode()


def split_timer(key: bytes) -> tuple[int, str]:
    body = key[len(TIMER) :]
    return _SEQ.unpack(body[:8])[0], body[8:].decode()
