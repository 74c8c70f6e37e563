"""What ``ctx.publish`` accepts and how it encodes it (``engine.api.outbox``), without a broker."""

from __future__ import annotations

from typing import Any

import pytest

from stepstream import InvalidPayload, InvalidWorkflowCall
from stepstream.engine.api.outbox import outbox_record, topic_problem
from stepstream.engine.wire.codec import JsonCodec


@pytest.mark.parametrize("topic", ["orders", "shop.orders_v2-eu", "a" * 249, "..."])
def test_kafka_topic_names_are_accepted(topic: str) -> None:
    assert topic_problem(topic) is None


@pytest.mark.parametrize("topic", ["", ".", "..", "a" * 250, "a b", "a/b", "été", 7])
def test_names_kafka_refuses_are_refused(topic: Any) -> None:
    assert topic_problem(topic) is not None


def test_values_are_encoded_by_the_codec_and_bytes_go_as_they_are() -> None:
    codec = JsonCodec()
    record = outbox_record("t", {"a": [1, "é"]}, "k", {"h": "v", "b": b"\xff"}, codec=codec)
    assert record.value == '{"a":[1,"é"]}'.encode()
    assert record.key == b"k"
    assert record.headers == (("h", b"v"), ("b", b"\xff"))
    raw = outbox_record("t", b"\x00raw", b"\x01", None, codec=codec)
    assert (raw.value, raw.key, raw.headers) == (b"\x00raw", b"\x01", ())


@pytest.mark.parametrize(
    ("value", "key", "headers", "error", "message"),
    [
        ({1, 2}, None, None, InvalidPayload, "publish bytes, or a value the payload codec takes"),
        (1, 5, None, InvalidWorkflowCall, "key must be str, bytes or None, not int"),
        (1, None, [("h", "v")], InvalidWorkflowCall, "headers must be a dict"),
        (1, None, {"h": 1}, InvalidWorkflowCall, "header 'h' must be str or bytes, not int"),
        (1, None, {"": "v"}, InvalidWorkflowCall, "header names must be non-empty strings"),
        (1, None, {"StepStream-Id": "x"}, InvalidWorkflowCall, "is stepstream's own"),
    ],
)
def test_bad_input_is_refused_saying_what_to_do(
    value: Any, key: Any, headers: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(")):
        outbox_record("orders", value, key, headers, codec=JsonCodec())
