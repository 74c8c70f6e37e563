"""Protobuf fields of OTLP spans, written by hand (``ops/telemetry/otlp_wire.py`` puts
them together): varint-length fields, attributes, events, links and the span itself, and
the W3C ``traceparent`` parsed as the wire needs it.

Wire format: https://protobuf.dev/programming-guides/encoding/ ; messages from
opentelemetry/proto/trace/v1/trace.proto (field numbers in the comments).
"""

from __future__ import annotations

import struct

from opentelemetry.semconv._incubating.attributes.messaging_attributes import (
    MESSAGING_BATCH_MESSAGE_COUNT,
    MESSAGING_CONSUMER_GROUP_NAME,
    MESSAGING_DESTINATION_NAME,
    MESSAGING_DESTINATION_PARTITION_ID,
    MESSAGING_KAFKA_MESSAGE_KEY,
    MESSAGING_KAFKA_OFFSET,
    MESSAGING_MESSAGE_ID,
    MESSAGING_OPERATION_NAME,
    MESSAGING_OPERATION_TYPE,
    MESSAGING_SYSTEM,
)
from opentelemetry.semconv.attributes.exception_attributes import (
    EXCEPTION_MESSAGE,
    EXCEPTION_STACKTRACE,
    EXCEPTION_TYPE,
)

from stepstream.engine.wire.uvarint import uvarint
from stepstream.ops.telemetry import span_attributes as shape

INTERNAL, PRODUCER, CONSUMER = 1, 4, 5  # Span.SpanKind
STATUS_ERROR = 2  # Status.StatusCode
SAMPLED = 0x01  # W3C trace flags
# Span.flags: bit 8 says whether bit 9 (the parent is remote) is known. (Bits 0-7 may
# carry the W3C flags; OpenTelemetry's Python SDK leaves them 0, and so do we.)
HAS_IS_REMOTE, IS_REMOTE = 0x100, 0x200

_Q = struct.Struct("<Q").pack
_I = struct.Struct("<I").pack


def field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (``tag`` is its first byte: field number << 3 | 2)."""
    n = len(payload)
    if n < 0x80:
        return bytes((tag, n)) + payload
    return bytes((tag,)) + uvarint(n) + payload


def str_attr(key: bytes, value: str, tag: int = 0x4A) -> bytes:
    """Span.attributes (9; ``tag`` 0x1A: Event.attributes, 3): KeyValue{key (1),
    value (2): AnyValue{string_value (1)}}."""
    v = value.encode()
    n = len(v)
    if len(key) + n + 4 < 0x80:  # every length fits one byte: written at once
        return bytes((tag, len(key) + n + 4)) + key + bytes((0x12, n + 2, 0x0A, n)) + v
    return field(tag, key + field(0x12, field(0x0A, v)))


class Repeated:
    """Attributes whose values repeat from span to span (workflow, step, outcome,
    partition), encoded once each."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._done: dict[tuple[bytes, str], bytes] = {}

    def __call__(self, key: bytes, value: str) -> bytes:
        encoded = self._done.get((key, value))
        if encoded is None:
            if len(self._done) >= self.LIMIT:
                self._done.clear()
            encoded = self._done[key, value] = str_attr(key, value)
        return encoded


def int_attr(key: bytes, value: int) -> bytes:
    """KeyValue with AnyValue{int_value (3)}, an int64 varint."""
    return field(0x4A, key + field(0x12, b"\x18" + uvarint(value & 0xFFFFFFFFFFFFFFFF)))


def attr_key(name: str) -> bytes:
    return field(0x0A, name.encode())


K_WORKFLOW = attr_key("stepstream.workflow")
K_STEP = attr_key("stepstream.step")
K_STEP_KEY = attr_key("stepstream.step.key")
K_ATTEMPT = attr_key("stepstream.attempt")
K_INSTANCE = attr_key("stepstream.instance_id")
K_OUTCOME = attr_key("stepstream.outcome")
K_PARTITION = attr_key("stepstream.partition")
K_VERSION = attr_key("stepstream.version")
K_INPUTS = attr_key("stepstream.inputs")
K_STATUS = attr_key("stepstream.status")
K_COMMAND = attr_key("stepstream.command")
K_SYSTEM = attr_key(MESSAGING_SYSTEM)
K_DESTINATION = attr_key(MESSAGING_DESTINATION_NAME)
K_GROUP = attr_key(MESSAGING_CONSUMER_GROUP_NAME)
K_PARTITION_ID = attr_key(MESSAGING_DESTINATION_PARTITION_ID)
K_MESSAGE_ID = attr_key(MESSAGING_MESSAGE_ID)
K_OFFSET = attr_key(MESSAGING_KAFKA_OFFSET)
K_MESSAGE_KEY = attr_key(MESSAGING_KAFKA_MESSAGE_KEY)
K_BATCH = attr_key(MESSAGING_BATCH_MESSAGE_COUNT)
K_EXCEPTION_TYPE = attr_key(EXCEPTION_TYPE)
K_EXCEPTION_MESSAGE = attr_key(EXCEPTION_MESSAGE)
K_EXCEPTION_STACKTRACE = attr_key(EXCEPTION_STACKTRACE)
# The messaging operation of a command's span and of an activation's.
SEND_OPERATION = str_attr(attr_key(MESSAGING_OPERATION_TYPE), "send") + str_attr(
    attr_key(MESSAGING_OPERATION_NAME), "send"
)
PROCESS_OPERATION = str_attr(attr_key(MESSAGING_OPERATION_TYPE), shape.PROCESS) + str_attr(
    attr_key(MESSAGING_OPERATION_NAME), shape.PROCESS
)
EXCEPTION_NAME = field(0x12, shape.EXCEPTION.encode())  # Event.name (2)
EMPTY_STATUS = b"\x7a\x00"  # Span.status (15): code UNSET
RUNS_KEPT = 4096  # runs whose parent is remembered for their next attempts


class Parent:
    """A span's parent as the wire needs it: ids, flags and the W3C tracestate."""

    __slots__ = ("flags", "span_id", "state", "trace_id")

    def __init__(self, trace_id: bytes, span_id: bytes, flags: int, state: str) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.flags = flags
        self.state = state

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)


def parse_traceparent(traceparent: str | None, tracestate: str | None) -> Parent | None:
    """The client's span from a W3C ``traceparent`` (None if absent or malformed, as
    OpenTelemetry's propagator treats it)."""
    if not traceparent:
        return None
    parts = traceparent.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    version, trace_hex, span_hex, flags_hex = parts[:4]
    if version == "00" and len(parts) != 4:
        return None
    if len(trace_hex) != 32 or len(span_hex) != 16 or len(flags_hex) != 2:
        return None
    try:
        trace_id, span_id, flags = (
            bytes.fromhex(trace_hex),
            bytes.fromhex(span_hex),
            int(flags_hex, 16),
        )
    except ValueError:
        return None
    if not any(trace_id) or not any(span_id):
        return None
    return Parent(trace_id, span_id, flags, tracestate or "")


def error_status(message: str) -> bytes:
    """Span.status (15): Status{message (2), code (3) ERROR}."""
    return field(0x7A, field(0x12, message.encode()) + b"\x18\x02")


def exception_event(error_type: str, message: str, stacktrace: str, time_ns: int) -> bytes:
    """Span.events (11): the ``exception`` Event{time_unix_nano (1), name (2),
    attributes (3)}."""
    body = b"".join(
        (
            b"\x09",
            _Q(time_ns),
            EXCEPTION_NAME,
            str_attr(K_EXCEPTION_TYPE, error_type, 0x1A),
            str_attr(K_EXCEPTION_MESSAGE, message, 0x1A),
            str_attr(K_EXCEPTION_STACKTRACE, stacktrace, 0x1A) if stacktrace else b"",
        )
    )
    return field(0x5A, body)


def failure(error_type: str, message: str, stacktrace: str, time_ns: int) -> tuple[bytes, bytes]:
    """A failed span's (events, status)."""
    return (
        exception_event(error_type, message, stacktrace, time_ns),
        error_status(shape.error_description(error_type, message)),
    )


def link(parent: Parent) -> bytes:
    """Span.links (13): Link{trace_id (1), span_id (2), flags (6)}, a remote context
    (the SDK's encoder leaves the link's trace_state out, and so do we)."""
    return field(
        0x6A,
        b"\x0a\x10"
        + parent.trace_id
        + b"\x12\x08"
        + parent.span_id
        + b"\x35"
        + _I(HAS_IS_REMOTE | IS_REMOTE),
    )


def span_bytes(
    trace_id: bytes,
    span_id: bytes,
    state: str,
    parent: bytes | None,
    name: str,
    kind: int,
    start_ns: int,
    end_ns: int,
    attributes: bytes,
    status: bytes,
    remote_parent: bool,
    events: bytes = b"",
    links: bytes = b"",
) -> bytes:
    body = b"".join(
        (
            b"\x0a\x10",  # trace_id (1), 16 bytes
            trace_id,
            b"\x12\x08",  # span_id (2), 8 bytes
            span_id,
            field(0x1A, state.encode()) if state else b"",  # trace_state (3)
            b"\x22\x08" + parent if parent is not None else b"",  # parent_span_id (4)
            field(0x2A, name.encode()),  # name (5)
            b"\x30",  # kind (6)
            bytes((kind,)),
            b"\x39",  # start_time_unix_nano (7), fixed64
            _Q(start_ns),
            b"\x41",  # end_time_unix_nano (8), fixed64
            _Q(end_ns),
            attributes,
            events,  # events (11)
            links,  # links (13)
            status,
            b"\x85\x01",  # flags (16), fixed32
            _I(HAS_IS_REMOTE | (IS_REMOTE if remote_parent else 0)),  # as the SDK writes it
        )
    )
    return field(0x12, body)  # ScopeSpans.spans (2)


def id8(value: int) -> bytes:
    return value.to_bytes(8, "big")
