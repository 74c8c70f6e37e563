"""Avro binary primitives: zig-zag variable-length longs and ints, strings, bytes,
booleans and null, written into a bytearray and read from bytes at an offset.

Readers raise ``Malformed`` for a body that does not follow the format, saying where.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

_LONG_MIN: Final = -(1 << 63)
_LONG_MAX: Final = (1 << 63) - 1
_INT_MIN: Final = -(1 << 31)
_INT_MAX: Final = (1 << 31) - 1

Writer = Callable[[bytearray, Any], None]
Reader = Callable[[bytes, int], tuple[Any, int]]


class Malformed(ValueError):
    """The body does not follow its writer schema; the message says where."""


# Encoded big longs seen lately: record times and fire times repeat within a batch.
_LONG_CACHE: dict[int, bytes] = {}
_LONG_CACHE_SIZE = 4096


def write_long(buf: bytearray, n: int) -> None:
    if -64 <= n <= 63:
        buf.append((n << 1) ^ (n >> 63))
        return
    encoded = _LONG_CACHE.get(n)
    if encoded is None:
        if not _LONG_MIN <= n <= _LONG_MAX:
            raise OverflowError(f"{n} does not fit in an Avro long (64-bit signed)")
        out = bytearray()
        z = (n << 1) ^ (n >> 63)
        while z > 0x7F:
            out.append((z & 0x7F) | 0x80)
            z >>= 7
        out.append(z)
        encoded = bytes(out)
        if len(_LONG_CACHE) >= _LONG_CACHE_SIZE:
            _LONG_CACHE.clear()
        _LONG_CACHE[n] = encoded
    buf += encoded


def write_int(buf: bytearray, n: int) -> None:
    if not _INT_MIN <= n <= _INT_MAX:
        raise OverflowError(f"{n} does not fit in an Avro int (32-bit signed)")
    write_long(buf, n)


def _write_string(buf: bytearray, s: str) -> None:
    data = s.encode()
    write_long(buf, len(data))
    buf += data


def _write_bytes(buf: bytearray, b: bytes) -> None:
    write_long(buf, len(b))
    buf += b


def write_boolean(buf: bytearray, v: bool) -> None:
    if v is True:
        buf.append(1)
    elif v is False:
        buf.append(0)
    else:
        raise TypeError(f"expected a bool, got {type(v).__name__}")


def write_null(buf: bytearray, v: None) -> None:
    if v is not None:
        raise TypeError(f"expected None, got {type(v).__name__}")


def read_long(b: bytes, i: int) -> tuple[int, int]:
    c = b[i]
    if c < 0x80:
        return (c >> 1) ^ -(c & 1), i + 1
    z = c & 0x7F
    shift = 7
    i += 1
    while True:
        c = b[i]
        i += 1
        z |= (c & 0x7F) << shift
        if c < 0x80:
            break
        shift += 7
        if shift > 63:
            raise Malformed(f"variable-length integer longer than 10 bytes at byte {i}")
    if z >> 64:
        raise Malformed(f"variable-length integer ending at byte {i} exceeds 64 bits")
    return (z >> 1) ^ -(z & 1), i


def _read_int(b: bytes, i: int) -> tuple[int, int]:
    n, end = read_long(b, i)
    if not _INT_MIN <= n <= _INT_MAX:
        raise Malformed(f"int at byte {i} is {n}, outside 32 bits")
    return n, end


def _read_bytes(b: bytes, i: int) -> tuple[bytes, int]:
    n, i = read_long(b, i)
    end = i + n
    if n < 0 or end > len(b):
        raise Malformed(f"bytes length {n} at byte {i}, {len(b) - i} left (truncated?)")
    return b[i:end], end


def _read_string(b: bytes, i: int) -> tuple[str, int]:
    n, i = read_long(b, i)
    end = i + n
    if n < 0 or end > len(b):
        raise Malformed(f"string length {n} at byte {i}, {len(b) - i} left (truncated?)")
    return b[i:end].decode(), end


def _read_boolean(b: bytes, i: int) -> tuple[bool, int]:
    c = b[i]
    if c > 1:
        raise Malformed(f"boolean byte {c} at byte {i} is neither 0 nor 1")
    return c == 1, i + 1


def _read_null(b: bytes, i: int) -> tuple[None, int]:
    return None, i


WRITERS: Final[Mapping[str, Writer]] = {
    "null": write_null,
    "boolean": write_boolean,
    "int": write_int,
    "long": write_long,
    "string": _write_string,
    "bytes": _write_bytes,
}
READERS: Final[Mapping[str, Reader]] = {
    "null": _read_null,
    "boolean": _read_boolean,
    "int": _read_int,
    "long": read_long,
    "string": _read_string,
    "bytes": _read_bytes,
}
PYTHON_TYPES: Final[Mapping[str, tuple[type[Any], ...]]] = {
    "null": (type(None),),
    "boolean": (bool,),
    "int": (int,),
    "long": (int,),
    "float": (float, int),
    "double": (float, int),
    "string": (str,),
    "bytes": (bytes, bytearray, memoryview),
}
