"""OTLP/protobuf requests for stepstream's two span shapes, encoded by hand.

The OpenTelemetry SDK makes each span an object, then its OTLP encoder turns every
span, attribute and value into protobuf messages: about 40 µs a span in Python. A run's
and a step attempt's span always have the same fields and attribute keys, so their
bytes are written here directly from the tuples ``Telemetry`` hands over (about a
tenth of that). The request is byte-for-byte an ``ExportTraceServiceRequest`` (a test
decodes it with the OTLP protobuf classes and compares it with the SDK's encoding of the
same spans); the resource and the scope are encoded once, by the protobuf classes.

Wire format: https://protobuf.dev/programming-guides/encoding/ ; messages from
opentelemetry/proto/trace/v1/trace.proto (field numbers in the comments).
"""

from __future__ import annotations

import logging
import random
import struct
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from stepstream.consumers.telemetry import RunSpan, StepSpan
from stepstream.engine.wire.uvarint import uvarint
from stepstream.ops.telemetry.tracing import run_span_id, trace_id_of_run, tracing_enabled
from stepstream.producers.trace_context import ProducerSpan

log = logging.getLogger("stepstream.tracing")

AnySpan = StepSpan | RunSpan | ProducerSpan

SCOPE = "stepstream.worker"
CLIENT_SCOPE = "stepstream.client"
INTERNAL, PRODUCER, CONSUMER = 1, 4, 5  # Span.SpanKind
STATUS_ERROR = 2  # Status.StatusCode
SAMPLED = 0x01  # W3C trace flags
# Span.flags: bit 8 says whether bit 9 (the parent is remote) is known. (Bits 0-7 may
# carry the W3C flags; OpenTelemetry's Python SDK leaves them 0, and so do we.)
HAS_IS_REMOTE, IS_REMOTE = 0x100, 0x200

_Q = struct.Struct("<Q").pack
_I = struct.Struct("<I").pack


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (``tag`` is its first byte: field number << 3 | 2)."""
    n = len(payload)
    if n < 0x80:
        return bytes((tag, n)) + payload
    return bytes((tag,)) + uvarint(n) + payload


def _str_attr(key: bytes, value: str) -> bytes:
    """Span.attributes (9): KeyValue{key (1), value (2): AnyValue{string_value (1)}}."""
    v = value.encode()
    n = len(v)
    if len(key) + n + 4 < 0x80:  # every length fits one byte: written at once
        return bytes((0x4A, len(key) + n + 4)) + key + bytes((0x12, n + 2, 0x0A, n)) + v
    return _field(0x4A, key + _field(0x12, _field(0x0A, v)))


class _Repeated:
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
            encoded = self._done[key, value] = _str_attr(key, value)
        return encoded


def _int_attr(key: bytes, value: int) -> bytes:
    """KeyValue with AnyValue{int_value (3)}, an int64 varint."""
    return _field(0x4A, key + _field(0x12, b"\x18" + uvarint(value & 0xFFFFFFFFFFFFFFFF)))


def _key(name: str) -> bytes:
    return _field(0x0A, name.encode())


K_WORKFLOW = _key("stepstream.workflow")
K_STEP = _key("stepstream.step")
K_STEP_KEY = _key("stepstream.step.key")
K_ATTEMPT = _key("stepstream.attempt")
K_INSTANCE = _key("stepstream.instance_id")
K_OUTCOME = _key("stepstream.outcome")
K_PARTITION = _key("messaging.destination.partition.id")
K_VERSION = _key("stepstream.version")
K_DESTINATION = _key("messaging.destination.name")
K_MESSAGE_KEY = _key("messaging.kafka.message.key")
K_COMMAND = _key("stepstream.command")
# The producer span's constant attributes.
SEND_CONSTANTS = (
    _str_attr(_key("messaging.system"), "kafka")
    + _str_attr(_key("messaging.operation.type"), "send")
    + _str_attr(_key("messaging.operation.name"), "send")
)
# The run span's constant attributes (messaging conventions), written once.
RUN_CONSTANTS = (
    _str_attr(_key("messaging.system"), "kafka")
    + _str_attr(_key("messaging.operation.type"), "process")
    + _str_attr(_key("messaging.operation.name"), "process")
)
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


def _error(message: str) -> bytes:
    """Span.status (15): Status{message (2), code (3) ERROR}."""
    return _field(0x7A, _field(0x12, message.encode()) + b"\x18\x02")


def _span(
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
) -> bytes:
    body = b"".join(
        (
            b"\x0a\x10",  # trace_id (1), 16 bytes
            trace_id,
            b"\x12\x08",  # span_id (2), 8 bytes
            span_id,
            _field(0x1A, state.encode()) if state else b"",  # trace_state (3)
            b"\x22\x08" + parent if parent is not None else b"",  # parent_span_id (4)
            _field(0x2A, name.encode()),  # name (5)
            b"\x30",  # kind (6)
            bytes((kind,)),
            b"\x39",  # start_time_unix_nano (7), fixed64
            _Q(start_ns),
            b"\x41",  # end_time_unix_nano (8), fixed64
            _Q(end_ns),
            attributes,
            status,
            b"\x85\x01",  # flags (16), fixed32
            _I(HAS_IS_REMOTE | (IS_REMOTE if remote_parent else 0)),  # as the SDK writes it
        )
    )
    return _field(0x12, body)  # ScopeSpans.spans (2)


def _id8(value: int) -> bytes:
    return value.to_bytes(8, "big")


class SpanEncoder:
    """Encodes batches of runs and attempts into OTLP export requests, keeping only the
    spans the sampler decides to sample."""

    def __init__(self, resource_attributes: Mapping[str, Any], sampler: Any = None) -> None:
        """``sampler``: None samples by the parent's flag (OpenTelemetry's default,
        ``parentbased_always_on``); else an SDK sampler asked about each span."""
        resource = Resource(
            attributes=[KeyValue(key=k, value=_any(v)) for k, v in resource_attributes.items()]
        )
        self._resource = _field(0x0A, resource.SerializeToString())  # ResourceSpans.resource
        # ScopeSpans.scope (1): the worker's spans, and the commands' producer spans
        self._scope = _field(0x0A, InstrumentationScope(name=SCOPE).SerializeToString())
        client = InstrumentationScope(name=CLIENT_SCOPE)
        self._client_scope = _field(0x0A, client.SerializeToString())
        self._sampler = sampler
        self._random = random.Random()
        self._attr = _Repeated()
        self._runs: dict[tuple[str, int, str | None, str | None], Parent] = {}

    def request(self, spans: Iterable[AnySpan]) -> tuple[bytes, int]:
        """An ``ExportTraceServiceRequest`` and the number of spans in it."""
        worker: list[bytes] = []
        client: list[bytes] = []
        for span in spans:
            encoded = self.encode(span)
            if encoded is not None:
                (client if isinstance(span, ProducerSpan) else worker).append(encoded)
        scope_spans = b"".join(  # ResourceSpans.scope_spans (2), one per scope
            _field(0x12, scope + b"".join(encoded))
            for scope, encoded in ((self._scope, worker), (self._client_scope, client))
            if encoded
        )
        return _field(0x0A, self._resource + scope_spans), len(worker) + len(client)

    def encode(self, span: AnySpan) -> bytes | None:
        if isinstance(span, StepSpan):
            return self.step(span)
        if isinstance(span, RunSpan):
            return self.run(span)
        return self.producer(span)

    def producer(self, span: ProducerSpan) -> bytes | None:
        """A command's producer span: ``sending`` sampled it already."""
        attr = self._attr
        attributes = b"".join(
            (
                SEND_CONSTANTS,
                attr(K_DESTINATION, span.destination),
                _str_attr(K_MESSAGE_KEY, span.instance_id),
                attr(K_COMMAND, span.operation),
                _str_attr(K_INSTANCE, span.instance_id),
            )
        )
        return _span(
            span.trace_id.to_bytes(16, "big"),
            _id8(span.span_id),
            span.tracestate or "",
            _id8(span.parent_span_id) if span.parent_span_id else None,
            f"send {span.destination}",
            PRODUCER,
            span.start_ns,
            span.end_ns,
            attributes,
            _error(span.error) if span.error else EMPTY_STATUS,
            span.remote_parent,
        )

    def _sampled(self, parent: Parent | None, trace_id: bytes, name: str, kind: int) -> bool:
        if self._sampler is None:
            return parent is None or parent.sampled
        return _sdk_decision(self._sampler, parent, trace_id, name, kind)

    def _run_parent(self, span: StepSpan) -> Parent:
        """The run span an attempt belongs to, as its parent: worked out once per run
        (a run's attempts arrive together) rather than once per attempt."""
        key = (span.instance_id, span.run_start_ms, span.traceparent, span.tracestate)
        parent = self._runs.get(key)
        if parent is None:
            client = parse_traceparent(span.traceparent, span.tracestate)
            run_id = _id8(run_span_id(span.instance_id, span.run_start_ms))
            if client is not None:
                parent = Parent(client.trace_id, run_id, client.flags, client.state)
            else:
                trace = trace_id_of_run(span.instance_id, span.run_start_ms).to_bytes(16, "big")
                parent = Parent(trace, run_id, SAMPLED, "")
            if len(self._runs) >= RUNS_KEPT:
                self._runs.clear()
            self._runs[key] = parent
        return parent

    def step(self, span: StepSpan) -> bytes | None:
        parent = self._run_parent(span)
        name = f"step {span.step}"
        if not self._sampled(parent, parent.trace_id, name, INTERNAL):
            return None
        attr = self._attr
        attributes = b"".join(
            (
                attr(K_WORKFLOW, span.workflow),
                attr(K_STEP, span.step),
                _str_attr(K_STEP_KEY, span.key),
                _int_attr(K_ATTEMPT, span.attempt),
                _str_attr(K_INSTANCE, span.instance_id),
                attr(K_OUTCOME, span.outcome),
                attr(K_PARTITION, str(span.partition)),
            )
        )
        status = (
            _error(f"{span.error_type}: {span.error_message}") if span.error_type else EMPTY_STATUS
        )
        span_id = _id8(self._random.getrandbits(64) or 1)
        return _span(
            parent.trace_id,
            span_id,
            parent.state,
            parent.span_id,
            name,
            INTERNAL,
            span.start_ms * 1_000_000,
            span.end_ms * 1_000_000,
            attributes,
            status,
            True,
        )

    def run(self, span: RunSpan) -> bytes | None:
        client = parse_traceparent(span.traceparent, span.tracestate)
        if client is not None:
            trace_id = client.trace_id
        else:
            trace_id = trace_id_of_run(span.instance_id, span.start_ms).to_bytes(16, "big")
        name = f"process {span.workflow}"
        if not self._sampled(client, trace_id, name, CONSUMER):
            return None
        attr = self._attr
        attributes = b"".join(
            (
                RUN_CONSTANTS,
                attr(K_PARTITION, str(span.partition)),
                attr(K_WORKFLOW, span.workflow),
                attr(K_VERSION, span.version),
                _str_attr(K_INSTANCE, span.instance_id),
                attr(K_OUTCOME, span.outcome),
            )
        )
        failed = span.outcome == "failed"
        status = _error(f"{span.error_type}: {span.error_message}") if failed else EMPTY_STATUS
        return _span(
            trace_id,
            _id8(run_span_id(span.instance_id, span.start_ms)),
            client.state if client is not None else "",
            client.span_id if client is not None else None,
            name,
            CONSUMER,
            span.start_ms * 1_000_000,
            span.end_ms * 1_000_000,
            attributes,
            status,
            client is not None,
        )


def _any(value: Any) -> AnyValue:
    """A resource attribute's value (``OTEL_RESOURCE_ATTRIBUTES`` and the SDK's own)."""
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[_any(v) for v in value]))
    return AnyValue(string_value=str(value))


def _sdk_decision(
    sampler: Any, parent: Parent | None, trace_id: bytes, name: str, kind: int
) -> bool:
    """What an SDK sampler (``OTEL_TRACES_SAMPLER`` other than the default) decides."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace.sampling import Decision
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState

    context = None
    if parent is not None:
        remote = SpanContext(
            int.from_bytes(parent.trace_id, "big"),
            int.from_bytes(parent.span_id, "big"),
            True,
            TraceFlags(parent.flags),
            TraceState.from_header([parent.state]) if parent.state else TraceState(),
        )
        context = trace.set_span_in_context(trace.NonRecordingSpan(remote))
    result = sampler.should_sample(
        context, int.from_bytes(trace_id, "big"), name, SpanKind(kind - 1)
    )
    return bool(result.decision is Decision.RECORD_AND_SAMPLE)


class WireExport:
    """The exporter process's sink: each batch of runs and attempts becomes one OTLP
    request, sent by the OTLP/HTTP exporter's own client (endpoint, headers, TLS,
    compression, timeout and retries from the ``OTEL_EXPORTER_OTLP_*`` variables)."""

    def __init__(self, encoder: SpanEncoder, exporter: Any) -> None:
        self._encoder = encoder
        self._exporter = exporter
        self._send = exporter._client.export
        self.exported = 0
        self.dropped = 0

    def batch(self, spans: Iterable[AnySpan]) -> None:
        data, count = self._encoder.request(spans)
        if not count:
            return
        result = self._send(data)
        if result.success:
            self.exported += count
            return
        self.dropped += count
        log.warning(
            "could not export %d spans to the OTLP endpoint (%s); %d dropped so far",
            count,
            result.error or f"HTTP {result.status_code}",
            self.dropped,
        )

    def shutdown(self) -> None:
        self._exporter.shutdown()


def wire_from_env(env: Mapping[str, str], *, service: str) -> WireExport | None:
    """The hand-encoded OTLP/HTTP export the ``OTEL_*`` variables configure; None when
    tracing is off, or exports elsewhere than OTLP over HTTP with protobuf (the SDK's
    path then serves, ``ops.telemetry.span_direct``), or the exporter's client is not the one
    this was written against."""
    if not tracing_enabled(env):
        return None
    if (env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp") != "otlp":
        return None
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol.strip().lower() != "http/protobuf":
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME
    from opentelemetry.sdk.resources import Resource as SdkResource
    from opentelemetry.sdk.trace import TracerProvider

    exporter = OTLPSpanExporter()
    if not callable(getattr(getattr(exporter, "_client", None), "export", None)):
        log.warning("this OTLP exporter version is not the expected one; spans go the SDK's way")
        return None
    resource = SdkResource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service})
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    sampler = None if name in ("", "parentbased_always_on") else TracerProvider().sampler
    return WireExport(SpanEncoder(resource.attributes, sampler), exporter)
