"""Unsigned LEB128 varints (protobuf's and the embedded log keys' length prefixes)."""

from __future__ import annotations


def uvarint(n: int) -> bytes:
    """``n`` (>= 0) in 7-bit groups, least significant first, the high bit set on all
    but the last byte."""
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
