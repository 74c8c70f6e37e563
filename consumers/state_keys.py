"""Every reserved key of a partition's state store, in one place.

Layout (all keys local to one partition; ``<id>`` is an instance id, escaped):
  m\\0<id>                    instance meta (JSON, engine.replay.state_json)
  i\\0<id>\\0                  the instance's input, written once when it starts (a payload
                              as ``engine.replay.state_json.payload_bytes``; older metas hold it
                              inline)
  e\\0<id>\\0<key>              one entry per replay key
  b\\0<id>\\0<seq:8>            an event or message buffered until the code takes it (the
                              seq of its EventBuffered; older metas held them inline)
  h\\0<id>\\0<seq:8>            the instance's history records, Avro single-object encoded
  a\\0<id>                    index of unfinished instances (loaded on restore)
  c\\0<id>\\0<command>          a client command applied to the instance (duplicates skipped)
  f\\0<finished:8><id>        finished instances by when they finished (retention)
  s\\0<created:8><id>         every instance by when its run started (lists newest or
                              oldest first: ``InstanceReads.list_by_created``)
  l\\0<time:8>                the history log's end offset at that time (log trimming)
  v\\0finished-indexed         set once every finished instance is in the f\\0 index
  v\\0started-indexed          set once every instance is in the s\\0 index
  t\\0<fire_at:8><id>\\0<timer>  timer index ordered by fire time
  T\\0<id>\\0<timer>            (instance, timer id) -> fire time (to cancel)
  r\\0<id>\\0<message>          the instance's answer to a message (msg.complete)
  k\\0<id>\\0<seq:8>            a hook call still owed for the instance's record ``seq``
                              (``consumers.hooks``; deleted once the hook returned)
  w\\0<id>                    a finished instance whose queue withdrawals the next owner
                              publishes again: a restore folded the record that finished
                              it (``consumers.restore``; deleted once published)

An instance id is escaped so that no id's keys fall under another id's prefix, whatever
bytes ids hold: 0x01 becomes 0x01 0x01 and 0x00 becomes 0x01 0x02, so an escaped id has no
0x00 and the 0x00 after it ends it. Ids without those two bytes (every id clients may
send: ``engine.wire.names`` refuses control characters) are stored as they are. Timer ids are
unique within their instance only, so the timer index is keyed by both.
"""

from __future__ import annotations

import functools
import struct

META = b"m\x00"
INPUT = b"i\x00"
BUFFERED = b"b\x00"
ENTRY = b"e\x00"
HISTORY = b"h\x00"
ACTIVE = b"a\x00"
COMMAND = b"c\x00"
FINISHED = b"f\x00"
LOG_MARK = b"l\x00"
FINISHED_INDEXED = b"v\x00finished-indexed"
STARTED = b"s\x00"
STARTED_INDEXED = b"v\x00started-indexed"
TIMER = b"t\x00"
TIMER_BY_ID = b"T\x00"
HOOK = b"k\x00"
WITHDRAW = b"w\x00"
REPLY = b"r\x00"
_SEQ = struct.Struct(">Q")
_END = b"\x00"


@functools.lru_cache(maxsize=4096)  # one instance's keys are made several times a commit
def escape_id(instance_id: str) -> bytes:
    raw = instance_id.encode()
    if b"\x00" in raw or b"\x01" in raw:
        raw = raw.replace(b"\x01", b"\x01\x01").replace(b"\x00", b"\x01\x02")
    return raw


def unescape_id(raw: bytes) -> str:
    if b"\x01" in raw:
        out = bytearray()
        index = 0
        while index < len(raw):
            byte = raw[index]
            if byte == 1:
                index += 1
                byte = 0 if raw[index] == 2 else 1
            out.append(byte)
            index += 1
        raw = bytes(out)
    return raw.decode()


def meta(instance_id: str) -> bytes:
    return META + escape_id(instance_id)


def split_meta(key: bytes) -> str:
    return unescape_id(key[len(META) :])


def entry_prefix(instance_id: str) -> bytes:
    return ENTRY + escape_id(instance_id) + _END


def entry(instance_id: str, key: str) -> bytes:
    return entry_prefix(instance_id) + key.encode()


def history_prefix(instance_id: str) -> bytes:
    return HISTORY + escape_id(instance_id) + _END


def history(instance_id: str, seq: int) -> bytes:
    return history_prefix(instance_id) + _SEQ.pack(seq)


def input_key(instance_id: str) -> bytes:
    """The instance's input. Its own prefix as well (``instance_prefixes``), so that what
    copies or deletes an instance's keys by prefix takes it along."""
    return INPUT + escape_id(instance_id) + _END


def buffered_prefix(instance_id: str) -> bytes:
    return BUFFERED + escape_id(instance_id) + _END


def buffered(instance_id: str, seq: int) -> bytes:
    return buffered_prefix(instance_id) + _SEQ.pack(seq)


# The key families of ``instance_prefixes``, across all instances.
INSTANCE_FAMILIES = (INPUT, ENTRY, BUFFERED, HISTORY, COMMAND, REPLY)


def instance_prefixes(instance_id: str) -> tuple[bytes, ...]:
    """The prefixes of every key family one instance has (its input, entries, buffered
    events, history, applied commands, replies); its other single keys are ``meta``,
    ``active``, ``finished`` and ``started``."""
    return (
        input_key(instance_id),
        entry_prefix(instance_id),
        buffered_prefix(instance_id),
        history_prefix(instance_id),
        command_prefix(instance_id),
        reply_prefix(instance_id),
    )


def reply_prefix(instance_id: str) -> bytes:
    return REPLY + escape_id(instance_id) + _END


def reply(instance_id: str, message_id: str) -> bytes:
    """The instance's answer to a message (``msg.complete``), for a client's request()."""
    return reply_prefix(instance_id) + message_id.encode()


def active(instance_id: str) -> bytes:
    return ACTIVE + escape_id(instance_id)


def split_active(key: bytes) -> str:
    return unescape_id(key[len(ACTIVE) :])


def withdraw(instance_id: str) -> bytes:
    return WITHDRAW + escape_id(instance_id)


def split_withdraw(key: bytes) -> str:
    return unescape_id(key[len(WITHDRAW) :])


def command_prefix(instance_id: str) -> bytes:
    return COMMAND + escape_id(instance_id) + _END


def command(instance_id: str, command_id: str) -> bytes:
    return command_prefix(instance_id) + command_id.encode()


def finished(finished_ms: int, instance_id: str) -> bytes:
    return FINISHED + _SEQ.pack(finished_ms) + escape_id(instance_id)


def split_finished(key: bytes) -> tuple[int, str]:
    body = key[len(FINISHED) :]
    return _SEQ.unpack(body[:8])[0], unescape_id(body[8:])


def started(created_ms: int, instance_id: str) -> bytes:
    """The instance's key in the index by created time: ids that start in the same ms
    sort by id, as ``list_by_created`` orders them."""
    return STARTED + _SEQ.pack(created_ms) + escape_id(instance_id)


def split_started(key: bytes) -> tuple[int, str]:
    body = key[len(STARTED) :]
    return _SEQ.unpack(body[:8])[0], unescape_id(body[8:])


def log_mark(time_ms: int) -> bytes:
    return LOG_MARK + _SEQ.pack(time_ms)


def split_log_mark(key: bytes) -> int:
    return int(_SEQ.unpack(key[len(LOG_MARK) :])[0])


def encode_offset(offset: int) -> bytes:
    return _SEQ.pack(offset)


def decode_offset(raw: bytes) -> int:
    return int(_SEQ.unpack(raw)[0])


def timer(fire_at_ms: int, instance_id: str, timer_id: str) -> bytes:
    return TIMER + _SEQ.pack(fire_at_ms) + escape_id(instance_id) + _END + timer_id.encode()


def timer_prefix(fire_at_ms: int) -> bytes:
    """Where the index's timers due at ``fire_at_ms`` or later begin."""
    return TIMER + _SEQ.pack(fire_at_ms)


def timer_by_id(instance_id: str, timer_id: str) -> bytes:
    return TIMER_BY_ID + escape_id(instance_id) + _END + timer_id.encode()


def split_timer(key: bytes) -> tuple[int, str, str]:
    """(fire time, instance id, timer id) of a timer index key."""
    body = key[len(TIMER) :]
    instance, _, timer_id = body[8:].partition(_END)
    return _SEQ.unpack(body[:8])[0], unescape_id(instance), timer_id.decode()


def legacy_timer(key: bytes, value: bytes) -> tuple[int, str, str] | None:
    """(fire time, instance id, timer id) of a timer index key of the layout before the
    index was keyed by instance (timer id alone, the instance as the value); None for a
    key of today's layout, whose value is empty."""
    if not value:
        return None
    body = key[len(TIMER) :]
    return _SEQ.unpack(body[:8])[0], value.decode(), body[8:].decode()


def legacy_timer_by_id(key: bytes) -> bool:
    """Whether a ``T`` key is of the layout before the index was keyed by instance."""
    return _END not in key[len(TIMER_BY_ID) :]


def hook(instance_id: str, seq: int) -> bytes:
    return HOOK + escape_id(instance_id) + _END + _SEQ.pack(seq)


def split_hook(key: bytes) -> tuple[str, int]:
    """(instance id, history seq) of a hook outbox key."""
    body = key[len(HOOK) :]
    return unescape_id(body[:-9]), int(_SEQ.unpack(body[-8:])[0])
