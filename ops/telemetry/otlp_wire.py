"""OTLP/protobuf requests for stepstream's span shapes, encoded by hand.

The OpenTelemetry SDK makes each span an object, then its OTLP encoder turns every
span, attribute and value into protobuf messages: about 40 µs a span in Python. An
activation's, a step attempt's and a command's span always have the same fields and
attribute keys (``ops/telemetry/span_attributes.py``), so their bytes are written here
(fields from ``ops/telemetry/otlp_fields.py``) directly from the tuples ``Telemetry``
hands over, in about a tenth of that. The request is byte-for-byte an
``ExportTraceServiceRequest`` (a test decodes it with the OTLP protobuf classes and
compares it with the SDK's encoding of the same spans); the resource and the scope are
encoded once, by the protobuf classes.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from stepstream.consumers.spans import ActivationSpan, StepSpan
from stepstream.engine.wire.run_trace import run_span_id, trace_id_of_run
from stepstream.ops.telemetry import span_attributes as shape
from stepstream.ops.telemetry.otlp_fields import (
    CONSUMER,
    EMPTY_STATUS,
    INTERNAL,
    K_ATTEMPT,
    K_BATCH,
    K_COMMAND,
    K_DESTINATION,
    K_GROUP,
    K_INPUTS,
    K_INSTANCE,
    K_MESSAGE_ID,
    K_MESSAGE_KEY,
    K_OFFSET,
    K_OUTCOME,
    K_PARTITION,
    K_PARTITION_ID,
    K_STATUS,
    K_STEP,
    K_STEP_KEY,
    K_SYSTEM,
    K_VERSION,
    K_WORKFLOW,
    PROCESS_OPERATION,
    PRODUCER,
    RUNS_KEPT,
    SAMPLED,
    SEND_OPERATION,
    Parent,
    Repeated,
    error_status,
    failure,
    field,
    id8,
    int_attr,
    link,
    parse_traceparent,
    span_bytes,
    str_attr,
)
from stepstream.ops.telemetry.tracing import tracing_enabled
from stepstream.producers.trace_context import ProducerSpan, producer_name

log = logging.getLogger("stepstream.tracing")

AnySpan = StepSpan | ActivationSpan | ProducerSpan


class SpanEncoder:
    """Encodes batches of activations, attempts and commands into OTLP export requests,
    keeping only the spans the sampler decides to sample."""

    def __init__(self, resource_attributes: Mapping[str, Any], sampler: Any = None) -> None:
        """``sampler``: None samples by the parent's flag (OpenTelemetry's default,
        ``parentbased_always_on``); else an SDK sampler asked about each span."""
        resource = Resource(
            attributes=[KeyValue(key=k, value=_any(v)) for k, v in resource_attributes.items()]
        )
        self._resource = field(0x0A, resource.SerializeToString())  # ResourceSpans.resource
        # ScopeSpans.scope (1): the worker's spans, and the commands' producer spans
        version = shape.scope_version()
        worker = InstrumentationScope(name=shape.SCOPE, version=version)
        self._scope = field(0x0A, worker.SerializeToString())
        client = InstrumentationScope(name=shape.CLIENT_SCOPE, version=version)
        self._client_scope = field(0x0A, client.SerializeToString())
        self._sampler = sampler
        self._random = random.Random()
        self._attr = Repeated()
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
            field(0x12, scope + b"".join(encoded))
            for scope, encoded in ((self._scope, worker), (self._client_scope, client))
            if encoded
        )
        return field(0x0A, self._resource + scope_spans), len(worker) + len(client)

    def encode(self, span: AnySpan) -> bytes | None:
        if isinstance(span, StepSpan):
            return self.step(span)
        if isinstance(span, ActivationSpan):
            return self.activation(span)
        return self.producer(span)

    def producer(self, span: ProducerSpan) -> bytes | None:
        """A command's producer span: ``sending`` sampled it already."""
        attr = self._attr
        messaging = b""
        if span.system:
            messaging = b"".join(
                (
                    attr(K_SYSTEM, span.system),
                    SEND_OPERATION,
                    attr(K_DESTINATION, span.destination),
                    attr(K_PARTITION_ID, str(span.partition)) if span.partition >= 0 else b"",
                    str_attr(K_MESSAGE_KEY, span.instance_id),
                    str_attr(K_MESSAGE_ID, span.command_id),
                )
            )
        attributes = b"".join(
            (
                messaging,
                attr(K_COMMAND, span.operation),
                str_attr(K_INSTANCE, span.instance_id),
            )
        )
        return span_bytes(
            span.trace_id.to_bytes(16, "big"),
            id8(span.span_id),
            span.tracestate or "",
            id8(span.parent_span_id) if span.parent_span_id else None,
            producer_name(span.destination, span.operation),
            PRODUCER,
            span.start_ns,
            span.end_ns,
            attributes,
            error_status(span.error) if span.error else EMPTY_STATUS,
            span.remote_parent,
        )

    def _sampled(self, parent: Parent | None, trace_id: bytes, name: str, kind: int) -> bool:
        if self._sampler is None:
            return parent is None or parent.sampled
        return _sdk_decision(self._sampler, parent, trace_id, name, kind)

    def _run_parent(
        self, instance_id: str, run_start_ms: int, traceparent: str | None, tracestate: str | None
    ) -> Parent:
        """The run span, as the parent of the run's other spans: worked out once per run
        (a run's spans arrive together) rather than once per span."""
        key = (instance_id, run_start_ms, traceparent, tracestate)
        parent = self._runs.get(key)
        if parent is None:
            client = parse_traceparent(traceparent, tracestate)
            run_id = id8(run_span_id(instance_id, run_start_ms))
            if client is not None:
                parent = Parent(client.trace_id, run_id, client.flags, client.state)
            else:
                trace = trace_id_of_run(instance_id, run_start_ms).to_bytes(16, "big")
                parent = Parent(trace, run_id, SAMPLED, "")
            if len(self._runs) >= RUNS_KEPT:
                self._runs.clear()
            self._runs[key] = parent
        return parent

    def step(self, span: StepSpan) -> bytes | None:
        parent = self._run_parent(
            span.instance_id, span.run_start_ms, span.traceparent, span.tracestate
        )
        name = f"step {span.step}"
        if not self._sampled(parent, parent.trace_id, name, INTERNAL):
            return None
        attr = self._attr
        attributes = b"".join(
            (
                attr(K_WORKFLOW, span.workflow),
                attr(K_STEP, span.step),
                str_attr(K_STEP_KEY, span.key),
                int_attr(K_ATTEMPT, span.attempt),
                str_attr(K_INSTANCE, span.instance_id),
                attr(K_OUTCOME, span.outcome),
                int_attr(K_PARTITION, span.partition),
            )
        )
        end_ns = span.end_ms * 1_000_000
        events, status = b"", EMPTY_STATUS
        if span.error_type:
            events, status = failure(span.error_type, span.error_message, span.stacktrace, end_ns)
        span_id = id8(self._random.getrandbits(64) or 1)
        return span_bytes(
            parent.trace_id,
            span_id,
            parent.state,
            parent.span_id,
            name,
            INTERNAL,
            span.start_ms * 1_000_000,
            end_ns,
            attributes,
            status,
            True,
            events,
        )

    def activation(self, span: ActivationSpan) -> bytes | None:
        if span.first:  # the run span: under the span that sent the start, if any
            parent = parse_traceparent(span.traceparent, span.tracestate)
            if parent is not None:
                trace_id = parent.trace_id
            else:
                trace_id = trace_id_of_run(span.instance_id, span.run_start_ms).to_bytes(16, "big")
            span_id = id8(run_span_id(span.instance_id, span.run_start_ms))
        else:  # a later activation: under the run span
            parent = self._run_parent(
                span.instance_id, span.run_start_ms, span.traceparent, span.tracestate
            )
            trace_id, span_id = parent.trace_id, id8(self._random.getrandbits(64) or 1)
        name = shape.activation_name(span)
        if not self._sampled(parent, trace_id, name, CONSUMER):
            return None
        attr = self._attr
        messaging = b""
        if span.system:
            kafka = b""
            if span.commands:
                kafka = b"".join(
                    (
                        str_attr(K_MESSAGE_ID, span.command_id),
                        int_attr(K_OFFSET, span.offset),
                        str_attr(K_MESSAGE_KEY, span.instance_id),
                    )
                )
            messaging = b"".join(
                (
                    attr(K_SYSTEM, span.system),
                    PROCESS_OPERATION,
                    attr(K_DESTINATION, span.destination),
                    attr(K_GROUP, span.group),
                    attr(K_PARTITION_ID, str(span.partition)),
                    kafka,
                    int_attr(K_BATCH, span.commands) if span.commands > 1 else b"",
                )
            )
        attributes = b"".join(
            (
                messaging,
                attr(K_WORKFLOW, span.workflow),
                attr(K_VERSION, span.version),
                str_attr(K_INSTANCE, span.instance_id),
                int_attr(K_PARTITION, span.partition),
                attr(K_INPUTS, span.inputs),
                attr(K_STATUS, span.status),
            )
        )
        events, status = b"", EMPTY_STATUS
        if span.failed_here:
            events, status = failure(
                span.error_type, span.error_message, span.stacktrace, span.end_ns
            )
        links = b""
        for traceparent, tracestate in span.links:
            linked = parse_traceparent(traceparent, tracestate)
            if linked is not None:
                links += link(linked)
        return span_bytes(
            trace_id,
            span_id,
            parent.state if parent is not None else "",
            parent.span_id if parent is not None else None,
            name,
            CONSUMER,
            span.start_ns,
            span.end_ns,
            attributes,
            status,
            parent is not None,
            events,
            links,
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


WARN_EVERY_S = 10.0
_SDK_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http"


class WireExport:
    """The exporter process's sink: each batch of spans becomes one OTLP
    request, sent by the OTLP/HTTP exporter's own client (endpoint, headers, TLS,
    compression, timeout and retries from the ``OTEL_EXPORTER_OTLP_*`` variables)."""

    def __init__(self, encoder: SpanEncoder, exporter: Any) -> None:
        self._encoder = encoder
        self._exporter = exporter
        self._send = exporter._client.export
        self.exported = 0
        self.dropped = 0
        # A failure is warned of at once, then at most every WARN_EVERY_S with how many
        # batches failed since: an endpoint that is down fails every batch.
        self._warned_at = -WARN_EVERY_S
        self._unwarned = 0
        # This warning says why each batch failed: the exporter's own client need not
        # (it logs each retry, then the failure, of every batch).
        logging.getLogger(_SDK_EXPORTER_LOGGER).setLevel(logging.CRITICAL)

    def batch(self, spans: Iterable[AnySpan]) -> None:
        data, count = self._encoder.request(spans)
        if not count:
            return
        result = self._send(data)
        if result.success:
            self.exported += count
            return
        self.dropped += count
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY_S:
            self._unwarned += 1
            return
        since = (
            f", and {self._unwarned} more batches since the last warning" if self._unwarned else ""
        )
        self._warned_at, self._unwarned = now, 0
        log.warning(
            "could not export %d spans to the OTLP endpoint (%s)%s; %d dropped so far. "
            "The engine goes on without them: check that the collector at "
            "OTEL_EXPORTER_OTLP_ENDPOINT (or _TRACES_ENDPOINT) is up and reachable",
            count,
            result.error or f"HTTP {result.status_code}",
            since,
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
