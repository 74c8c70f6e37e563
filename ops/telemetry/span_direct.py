"""Spans made as finished ``ReadableSpan``s and handed to a span processor: how the
exporter process (``ops/telemetry/span_export.py``) makes them for exporters other than
OTLP over HTTP (which ``ops/telemetry/otlp_wire.py`` serves without SDK spans), and how a
process given a ``TracerProvider`` (``tracing.install``) makes them in process.

Everything about an activation's or an attempt's span is known when it is made (its
ids, times, parent, status, events), so the SDK's tracer would only spend time (about
25 µs a span against under 2 here) starting and ending a span for it. Names, attributes
and parents come from ``ops/telemetry/span_attributes.py``; the sampler the ``OTEL_*``
variables configure still decides.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    Link,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from stepstream.consumers.spans import ActivationSpan, StepSpan
from stepstream.engine.wire.run_trace import run_span_id, trace_id_of_run
from stepstream.ops.telemetry import span_attributes as shape
from stepstream.ops.telemetry.tracing import exporter_from_env, tracing_enabled
from stepstream.producers.trace_context import (
    ProducerSpan,
    producer_attributes,
    producer_name,
)

EXPORT_QUEUE = 65_536
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)


class DirectSpans:
    """A ``SpanSink`` that builds finished spans and ends them into ``processor``."""

    def __init__(self, processor: SpanProcessor, resource: Resource, sampler: Sampler) -> None:
        self._processor = processor
        self._resource = resource
        self._sampler = sampler
        self._scope = InstrumentationScope(shape.SCOPE, shape.scope_version())
        self._client_scope = InstrumentationScope(shape.CLIENT_SCOPE, shape.scope_version())
        self._random = random.Random()

    def _end(
        self,
        name: str,
        kind: SpanKind,
        ids: tuple[int, int],
        parent: SpanContext | None,
        attributes: shape.Attributes,
        times_ns: tuple[int, int],
        error: tuple[str, str, str] | None,
        links: Sequence[SpanContext] = (),
    ) -> None:
        trace_id, span_id = ids
        parent_context = (
            trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else None
        )
        sampled = self._sampler.should_sample(parent_context, trace_id, name, kind, attributes)
        if sampled.decision is not Decision.RECORD_AND_SAMPLE:
            return
        state = parent.trace_state if parent is not None else TraceState()
        context = SpanContext(trace_id, span_id, False, _SAMPLED, state)
        status: Status = _OK
        events: tuple[Event, ...] = ()
        if error is not None:
            status = Status(StatusCode.ERROR, shape.error_description(error[0], error[1]))
            event = Event(shape.EXCEPTION, shape.exception_attributes(*error), times_ns[1])
            events = (event,)
        self._processor.on_end(
            ReadableSpan(
                name=name,
                context=context,
                parent=parent,
                resource=self._resource,
                attributes=attributes,
                events=events,
                links=[Link(link) for link in links],
                kind=kind,
                status=status,
                start_time=times_ns[0],
                end_time=times_ns[1],
                instrumentation_scope=self._scope,
            )
        )

    def step(self, span: StepSpan) -> None:
        run = shape.run_context(
            span.instance_id, span.run_start_ms, span.traceparent, span.tracestate
        )
        self._end(
            shape.step_name(span),
            SpanKind.INTERNAL,
            (run.trace_id, self._random.getrandbits(64) or 1),
            run,
            shape.step_attributes(span),
            (span.start_ms * 1_000_000, span.end_ms * 1_000_000),
            (span.error_type, span.error_message, span.stacktrace) if span.error_type else None,
        )

    def activation(self, span: ActivationSpan) -> None:
        if span.first:  # the run span: under the span that sent the start, if any
            parent = shape.client_context(span.traceparent, span.tracestate)
            trace_id = (
                parent.trace_id if parent else trace_id_of_run(span.instance_id, span.run_start_ms)
            )
            span_id = run_span_id(span.instance_id, span.run_start_ms)
        else:  # a later activation: under the run span
            parent = shape.run_context(
                span.instance_id, span.run_start_ms, span.traceparent, span.tracestate
            )
            trace_id, span_id = parent.trace_id, self._random.getrandbits(64) or 1
        failed = span.failed_here
        self._end(
            shape.activation_name(span),
            SpanKind.CONSUMER,
            (trace_id, span_id),
            parent,
            shape.activation_attributes(span),
            (span.start_ns, span.end_ns),
            (span.error_type, span.error_message, span.stacktrace) if failed else None,
            shape.links(span),
        )

    def producer(self, span: ProducerSpan) -> None:
        """A command's producer span (``producers.trace_context``), sampled already."""
        parent = None
        if span.parent_span_id:
            parent = SpanContext(
                span.trace_id,
                span.parent_span_id,
                span.remote_parent,
                _SAMPLED,
                TraceState.from_header([span.tracestate]) if span.tracestate else TraceState(),
            )
        state = parent.trace_state if parent is not None else TraceState()
        self._processor.on_end(
            ReadableSpan(
                name=producer_name(span.destination, span.operation),
                context=SpanContext(span.trace_id, span.span_id, False, _SAMPLED, state),
                parent=parent,
                resource=self._resource,
                attributes=producer_attributes(
                    span.system,
                    span.destination,
                    span.partition,
                    span.instance_id,
                    span.operation,
                    span.command_id,
                ),
                kind=SpanKind.PRODUCER,
                status=_OK if span.error is None else Status(StatusCode.ERROR, span.error),
                start_time=span.start_ns,
                end_time=span.end_ns,
                instrumentation_scope=self._client_scope,
            )
        )

    def batch(self, spans: Iterable[StepSpan | ActivationSpan | ProducerSpan]) -> None:
        for span in spans:
            if isinstance(span, StepSpan):
                self.step(span)
            elif isinstance(span, ActivationSpan):
                self.activation(span)
            else:
                self.producer(span)

    def shutdown(self) -> None:
        self._processor.shutdown()  # exports what it still holds


def direct_from_env(env: Mapping[str, str], *, service: str) -> DirectSpans | None:
    """The exporter process's spans, configured by the ``OTEL_*`` variables."""
    if not tracing_enabled(env):
        return None
    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service})
    sampler = TracerProvider(resource=resource).sampler  # OTEL_TRACES_SAMPLER, as usual
    # Spans come in bursts of whole batches: a queue of the SDK's default 2,048 would
    # drop some. OTEL_BSP_MAX_QUEUE_SIZE still wins.
    queue_size = None if env.get("OTEL_BSP_MAX_QUEUE_SIZE") else EXPORT_QUEUE
    processor = BatchSpanProcessor(exporter_from_env(env), max_queue_size=queue_size)
    return DirectSpans(processor, resource, sampler)
