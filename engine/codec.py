"""Payload codecs: how user values become the bytes inside records, and back.

The default is JSON. A codec is the hook for encryption, compression or another format;
wrap the default and keep the content type honest so readers know what they hold.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from engine.errors import InvalidPayload, PayloadTooLarge
from engine.records import Payload

JSON = "application/json"
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
# Error messages and reasons are text from user code (an exception's str, a cancel
# reason): recorded, but never big enough to make a record the broker refuses.
MAX_MESSAGE_CHARS = 8 * 1024


class PayloadCodec(Protocol):
    """``encode`` and ``decode`` raise ``InvalidPayload`` for what they cannot handle;
    any other exception from them is treated the same way (see ``decode_safely``)."""

    def encode(self, value: Any) -> Payload: ...

    def decode(self, payload: Payload) -> Any: ...


def encode_safely(codec: PayloadCodec, value: Any) -> Payload:
    """``codec.encode``, with whatever a user's codec raises turned into InvalidPayload."""
    try:
        return codec.encode(value)
    except InvalidPayload:
        raise
    except Exception as exc:
        raise InvalidPayload(
            f"the payload codec cannot encode a value of type {type(value).__name__}: "
            f"{type(exc).__name__}: {exc}"
        ) from None


def decode_safely(codec: PayloadCodec, payload: Payload) -> Any:
    """``codec.decode``, with whatever a user's codec raises turned into InvalidPayload
    (a bad token from an encryption library must not take a partition down)."""
    try:
        return codec.decode(payload)
    except InvalidPayload:
        raise
    except Exception as exc:
        raise InvalidPayload(
            f"the payload codec cannot decode a {payload.content_type!r} payload: "
            f"{type(exc).__name__}: {exc}"
        ) from None


class JsonCodec:
    """JSON-compatible values only (dict, list, str, int, float, bool, None)."""

    content_type = JSON

    def __init__(self) -> None:
        self._encoder = json.JSONEncoder(
            ensure_ascii=False, allow_nan=False, separators=(",", ":"), check_circular=True
        )

    def encode(self, value: Any) -> Payload:
        try:
            text = self._encoder.encode(value)
        except (TypeError, ValueError) as exc:
            raise InvalidPayload(
                f"value of type {type(value).__name__} is not JSON-encodable ({exc}); "
                "return or pass only dict, list, str, int, float, bool or None, "
                "or configure a payload codec that handles it"
            ) from None
        return Payload(JSON, text.encode())

    def decode(self, payload: Payload) -> Any:
        if payload.content_type != JSON:
            raise InvalidPayload(
                f"payload has content type {payload.content_type!r}, this codec reads {JSON!r}; "
                "configure the codec the writer used"
            )
        try:
            return json.loads(payload.data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidPayload(f"payload is not valid JSON: {exc}") from None


def parse_json_text(text: str, *, what: str) -> Any:
    """Parse user-typed JSON (CLI flags, HTTP bodies) with a message that says what was wrong."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidPayload(f"{what} is not valid JSON: {exc}") from None


def check_size(payload: Payload, limit: int, *, what: str) -> Payload:
    if len(payload.data) > limit:
        raise PayloadTooLarge(
            f"{what} is {len(payload.data)} bytes, over the limit of {limit} bytes; "
            "store large data elsewhere and pass a reference, or raise the limit "
            "(STEPSTREAM_MAX_PAYLOAD_BYTES; keep the broker's message.max.bytes above it)"
        )
    return payload


def clip_message(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters cut]"
