"""The JSON codec reads every payload as ``json.loads`` would: the same value, or the
same refusal, whichever parser did the reading."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepstream.engine.errors import InvalidPayload
from stepstream.engine.wire.codec import JsonCodec, loads_json
from stepstream.engine.wire.records import Payload
from tests.json_values import json_values


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (1 is not 1.0 here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


@given(json_values(max_int=2**80), st.booleans())
def test_any_json_reads_as_json_loads_reads_it(value: Any, ascii_only: bool) -> None:
    data = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert _same(loads_json(data), json.loads(data))


@pytest.mark.parametrize(
    "data",
    [
        b"123456789012345678901234567890",  # past 64 bits: an int, not a float
        b"-9223372036854775809",
        b"[18446744073709551616, 1.5]",
        b'{"n": 1000000000000000000}',
        b"1E400",  # json reads infinities and NaN, orjson refuses them
        b"-1E400",
        b"NaN",
        b'"\\ud800"',  # a lone surrogate, escaped
        b"\xef\xbb\xbf1",  # a byte order mark
        '"é"'.encode("utf-16"),  # json detects UTF-16
        b"1.5e-400",
        b'{"a": 1, "a": 2}',
    ],
)
def test_what_the_fast_reader_would_read_otherwise_reads_as_json_does(data: bytes) -> None:
    assert _same(loads_json(data), json.loads(data))


@pytest.mark.parametrize("data", [b"[1, 2", b"\xff", b"", b"{'a': 1}", b"[" * 5000 + b"]" * 5000])
def test_what_json_refuses_the_codec_refuses_with_a_clear_error(data: bytes) -> None:
    with pytest.raises(InvalidPayload, match="payload"):
        JsonCodec().decode(Payload("application/json", data))
