"""Spans made as finished ``ReadableSpan``s and handed to the batch processor: how the
exporter process (``ops/telemetry/span_export.py``) makes them for exporters other than OTLP over
HTTP (which ``ops/telemetry/otlp_wire.py`` serves without SDK spans).

Everything about a run's or an attempt's span is known when it is made (its ids, times,
parent, status), so the SDK's tracer would only spend time (about 25 µs a span against
under 2 here) starting and ending a span for it. The same ids, names and attributes as
``ops.telemetry.tracing.OtelSpans``; the sampler the ``OTEL_*`` variables configure still decides.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Decision, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from stepstream.consumers.telemetry import RunSpan, StepSpan
from stepstream.ops.telemetry.tracing import (
    client_context,
    exporter_from_env,
    run_attributes,
    run_parent,
    run_span_id,
    step_attributes,
    trace_id_of_run,
    tracing_enabled,
)
from stepstream.producers.trace_context import ProducerSpan, producer_attributes

EXPORT_QUEUE = 65_536
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)


class DirectSpans:
    """A ``SpanSink`` that builds finished spans and ends them into ``processor``."""

    def __init__(self, processor: SpanProcessor, resource: Resource, sampler: Sampler) -> None:
        self._processor = processor
        self._resource = resource
        self._sampler = sampler
        self._scope = InstrumentationScope("stepstream.worker")
        self._client_scope = InstrumentationScope("stepstream.client")
        self._ids = RandomIdGenerator()

    def _end(
        self,
        name: str,
        kind: SpanKind,
        trace_id: int,
        span_id: int,
        parent: SpanContext | None,
        attributes: dict[str, str | int],
        times: tuple[int, int],
        error: str | None,
    ) -> None:
        parent_context = (
            trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else None
        )
        sampled = self._sampler.should_sample(parent_context, trace_id, name, kind, attributes)
        if sampled.decision is not Decision.RECORD_AND_SAMPLE:
            return
        state = parent.trace_state if parent is not None else TraceState()
        context = SpanContext(trace_id, span_id, False, _SAMPLED, state)
        self._processor.on_end(
            ReadableSpan(
                name=name,
                context=context,
                parent=parent,
                resource=self._resource,
                attributes=attributes,
                kind=kind,
                status=_OK if error is None else Status(StatusCode.ERROR, error),
                start_time=times[0] * 1_000_000,
                end_time=times[1] * 1_000_000,
                instrumentation_scope=self._scope,
            )
        )

    def step(self, span: StepSpan) -> None:
        run = run_parent(span)
        self._end(
            f"step {span.step}",
            SpanKind.INTERNAL,
            run.trace_id,
            self._ids.generate_span_id(),
            run,
            step_attributes(span),
            (span.start_ms, span.end_ms),
            f"{span.error_type}: {span.error_message}" if span.error_type else None,
        )

    def run(self, span: RunSpan) -> None:
        client = client_context(span.traceparent, span.tracestate)
        trace_id = client.trace_id if client else trace_id_of_run(span.instance_id, span.start_ms)
        self._end(
            f"process {span.workflow}",
            SpanKind.CONSUMER,
            trace_id,
            run_span_id(span.instance_id, span.start_ms),
            client,
            run_attributes(span),
            (span.start_ms, span.end_ms),
            f"{span.error_type}: {span.error_message}" if span.outcome == "failed" else None,
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
                name=f"send {span.destination}",
                context=SpanContext(span.trace_id, span.span_id, False, _SAMPLED, state),
                parent=parent,
                resource=self._resource,
                attributes=producer_attributes(span.destination, span.instance_id, span.operation),
                kind=SpanKind.PRODUCER,
                status=_OK if span.error is None else Status(StatusCode.ERROR, span.error),
                start_time=span.start_ns,
                end_time=span.end_ns,
                instrumentation_scope=self._client_scope,
            )
        )

    def batch(self, spans: Iterable[StepSpan | RunSpan | ProducerSpan]) -> None:
        for span in spans:
            if isinstance(span, StepSpan):
                self.step(span)
            elif isinstance(span, RunSpan):
                self.run(span)
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
