"""Payload codecs: how user values become the bytes inside records, and back.

The default is JSON. A codec is the hook for encryption, compression or another format;
wrap the default and keep the content type honest so readers know what they hold.
"""

from __future__ import annotations

import json
import re
import traceback
from typing import Any, Protocol

import orjson

from stepstream.engine.errors import InvalidPayload, PayloadTooLarge
from stepstream.engine.wire.records import Payload

JSON = "application/json"
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
# Error messages and reasons are text from user code (an exception's str, a cancel
# reason): recorded, but never big enough to make a record the broker refuses.
MAX_MESSAGE_CHARS = 8 * 1024
MAX_TRACEBACK_CHARS = 16_000
# JSON values nest at most this deep: deeper ones fail to parse or to encode somewhere
# down the line (Python's json recurses), so they are refused where they come in.
MAX_JSON_DEPTH = 512
# Text that may hold a UTF-16 surrogate (raw, or as a \u escape); only such text is
# checked for lone ones, which UTF-8 cannot encode.
_MAYBE_SURROGATE = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")
# 19 digits in a row: maybe an integer past 64 bits, which orjson reads as a float.
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


class PayloadCodec(Protocol):
    """``encode`` and ``decode`` raise ``InvalidPayload`` for what they cannot handle;
    any other exception from them is treated the same way (see ``decode_safely``)."""

    def encode(self, value: Any) -> Payload: ...

    def decode(self, payload: Payload) -> Any: ...


def encode_safely(codec: PayloadCodec, value: Any) -> Payload:
    """``codec.encode``, with whatever a user's codec raises, or returns that is not a
    ``Payload`` of a str content type and bytes, turned into InvalidPayload."""
    try:
        payload = codec.encode(value)
    except InvalidPayload:
        raise
    except Exception as exc:
        raise InvalidPayload(
            f"the payload codec cannot encode a value of type {type(value).__name__}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if (
        type(payload) is not Payload
        or type(payload.data) is not bytes
        or type(payload.content_type) is not str
    ):
        raise InvalidPayload(
            f"the payload codec {type(codec).__name__} returned {_shape(payload)} from "
            "encode; it must return stepstream.Payload(content_type=str, data=bytes)"
        )
    return payload


def _shape(payload: object) -> str:
    if isinstance(payload, Payload):
        return (
            f"a Payload of content_type {type(payload.content_type).__name__} and data "
            f"{type(payload.data).__name__}"
        )
    return f"a {type(payload).__name__}"


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


_NULL = Payload(JSON, b"null")


class JsonCodec:
    """JSON-compatible values only (dict, list, str, int, float, bool, None)."""

    content_type = JSON

    def __init__(self) -> None:
        self._encoder = json.JSONEncoder(
            ensure_ascii=False, allow_nan=False, separators=(",", ":"), check_circular=True
        )

    def encode(self, value: Any) -> Payload:
        if value is None:
            return _NULL  # a workflow or step that returns nothing
        try:
            text = self._encoder.encode(value)
        except RecursionError:
            raise InvalidPayload(_too_deep(f"value of type {type(value).__name__}")) from None
        except (TypeError, ValueError) as exc:
            raise InvalidPayload(
                f"value of type {type(value).__name__} is not JSON-encodable ({exc}); "
                "return or pass only dict, list, str, int, float, bool or None, "
                "or configure a payload codec that handles it"
            ) from None
        check_json_value(value, text, what=f"value of type {type(value).__name__}")
        return Payload(JSON, text.encode())

    def decode(self, payload: Payload) -> Any:
        if payload.content_type != JSON:
            raise InvalidPayload(
                f"payload has content type {payload.content_type!r}, this codec reads {JSON!r}; "
                "configure the codec the writer used"
            )
        return loads_json(payload.data)


def loads_json(data: bytes) -> Any:
    """``json.loads`` of ``data``: the same value for the same bytes, faster. orjson
    reads what it reads as ``json`` does; what it would read otherwise (integers past
    64 bits, which it makes floats) or refuses (``NaN``, a lone surrogate, a BOM, UTF-16)
    goes to ``json``, whose answer or error stands."""
    if not _LONG_DIGITS.search(data):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(data)
    except RecursionError:
        raise InvalidPayload(_too_deep("payload")) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidPayload(f"payload is not valid JSON: {exc}") from None


def parse_json_text(text: str, *, what: str) -> Any:
    """Parse user-typed JSON (CLI flags, HTTP bodies, session frames) with a message that
    says what was wrong. Refuses what the engine could not store or encode again: values
    nested deeper than ``MAX_JSON_DEPTH`` and lone surrogates (``"\\ud800"``)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise InvalidPayload(_too_deep(what)) from None
    except ValueError as exc:
        raise InvalidPayload(f"{what} is not valid JSON: {exc}") from None
    check_json_value(value, text, what=what)
    return value


def dump_json_text(value: Any, *, what: str) -> str:
    """``value`` as compact JSON text, refused (``InvalidPayload``) if it is not
    JSON-encodable, nests deeper than ``MAX_JSON_DEPTH`` or holds a lone surrogate."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except RecursionError:
        raise InvalidPayload(_too_deep(what)) from None
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(
            f"{what} is not JSON-encodable ({exc}); pass only dict, list, str, int, "
            "float (finite), bool or None"
        ) from None
    check_json_value(value, text, what=what)
    return text


def check_json_value(value: Any, text: str, *, what: str) -> None:
    """Refuse ``value`` (parsed from or encoded as ``text``) if it nests deeper than
    ``MAX_JSON_DEPTH`` or holds a lone surrogate. Cheap scans of ``text`` decide whether
    the value needs a closer look, so ordinary payloads cost two ``str.count`` calls and
    one regex search."""
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _nests_deeper(value):
        raise InvalidPayload(_too_deep(what))
    if _MAYBE_SURROGATE.search(text) is None:
        return
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end]
        raise InvalidPayload(
            f"{what} holds a lone surrogate ({bad!r}): a \\ud800-\\udfff escape that is "
            "not half of a pair is not Unicode text and cannot be stored; send valid "
            "Unicode (pairs such as \\ud83d\\ude00 are fine)"
        ) from None


def _nests_deeper(value: Any) -> bool:
    # Iterative: the point is to look at values too deep for recursion.
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def _too_deep(what: str) -> str:
    return (
        f"{what} nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects; "
        "flatten it (or store it elsewhere and pass a reference)"
    )


def check_size(payload: Payload, limit: int, *, what: str) -> Payload:
    if len(payload.data) > limit:
        raise PayloadTooLarge(
            f"{what} is {len(payload.data)} bytes, over the limit of {limit} bytes; "
            "store large data elsewhere and pass a reference, or raise the limit "
            "(STEPSTREAM_MAX_PAYLOAD_BYTES; keep the broker's message.max.bytes above it)"
        )
    return payload


def format_traceback(error: BaseException, limit: int = MAX_TRACEBACK_CHARS) -> str:
    """``error``'s traceback as Python prints it, its last ``limit`` characters (the
    innermost frames and the error itself) when longer."""
    text = "".join(traceback.format_exception(error))
    if len(text) <= limit:
        return text
    return f"[{len(text) - limit} characters cut]...\n{text[-limit:]}"


def error_message(error: BaseException) -> str:
    """What ``error`` says, for a record: its ``str``, else its ``repr``, else its type's
    name. The error is the user's, so its ``__str__`` may itself raise or return a
    non-string; that must not cost the outcome it is part of."""
    for render in (str, repr):
        try:
            text = render(error)
        except Exception:  # any failure of the user's method
            continue
        if text:
            return text
    return f"<{type(error).__name__} that cannot be shown>"


def clip_message(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters cut]"
