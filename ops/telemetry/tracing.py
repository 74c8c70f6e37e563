"""OpenTelemetry traces of a serving process: a span for each workflow run and each
step attempt, joined to the trace the client's start carried.

Spans are made from durable records when the work they describe ends (``Telemetry``
feeds ``OtelSpans``), with the start and end times the records hold. So a run that
started on one worker and ended on another after a restart is still one span, made by
whoever saw it end, in the trace its start record named. The run span's id is derived
from the instance, so step spans made anywhere, earlier, name it as their parent.

Configured by OpenTelemetry's standard variables. Tracing is on when an exporter is
named (``OTEL_TRACES_EXPORTER=otlp|console``) or an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), and off with
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``. ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and the OTLP exporter's own
variables apply as usual.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from stepstream.consumers.host import PartitionHost
from stepstream.consumers.telemetry import RunSpan, StepSpan
from stepstream.ops.telemetry.span_export import SpanExportProcess
from stepstream.producers import trace_context

log = logging.getLogger("stepstream.tracing")

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER_NAME = "stepstream.worker"
# The span id the next span gets (the run span's, derived from its instance); unset:
# random, as usual.
_next_span_id: ContextVar[int | None] = ContextVar("stepstream_next_span_id", default=None)
# Likewise the trace id of a run that started without trace context (a root span).
_next_trace_id: ContextVar[int | None] = ContextVar("stepstream_next_trace_id", default=None)


class StableIds(IdGenerator):
    """Random ids, except for a span whose id the caller fixed beforehand."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()

    def generate_span_id(self) -> int:
        fixed = _next_span_id.get()
        return fixed if fixed is not None else self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        fixed = _next_trace_id.get()
        return fixed if fixed is not None else self._random.generate_trace_id()


def tracing_enabled(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def exporter_from_env(env: Mapping[str, str]) -> SpanExporter:
    """The span exporter the ``OTEL_*`` variables name (OTLP over HTTP by default)."""
    kind = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if kind == "console":
        return ConsoleSpanExporter()
    if kind != "otlp":
        log.warning("OTEL_TRACES_EXPORTER=%s is not supported here; using otlp", kind)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def provider_from_env(
    env: Mapping[str, str], *, service: str, install_global: bool = True
) -> TracerProvider | None:
    """A tracer provider exporting where the ``OTEL_*`` variables say; None when tracing
    is off. Also installed as the process's global provider (unless ``install_global``
    is False), so the producer spans of commands this process publishes (API requests)
    are recorded too."""
    if not tracing_enabled(env):
        return None
    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service})
    provider = TracerProvider(resource=resource, id_generator=StableIds())
    provider.add_span_processor(BatchSpanProcessor(exporter_from_env(env)))
    if install_global:
        trace.set_tracer_provider(provider)
    return provider


def install(host: PartitionHost, provider: TracerProvider) -> OtelSpans:
    """Make ``host``'s runs and step attempts into spans of ``provider``."""
    spans = OtelSpans(provider)
    host.telemetry.spans = spans
    return spans


def run_span_id(instance_id: str, start_ms: int) -> int:
    """The run span's id: the same wherever it is computed, never 0."""
    digest = hashlib.blake2b(f"{instance_id}\0{start_ms}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def client_context(traceparent: str | None, tracestate: str | None) -> SpanContext | None:
    """The client's span a run belongs under, if its start carried one."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    parent = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return parent if parent.is_valid else None


def step_attributes(span: StepSpan) -> dict[str, str | int]:
    return {
        "stepstream.workflow": span.workflow,
        "stepstream.step": span.step,
        "stepstream.step.key": span.key,
        "stepstream.attempt": span.attempt,
        "stepstream.instance_id": span.instance_id,
        "stepstream.outcome": span.outcome,
        "messaging.destination.partition.id": str(span.partition),
    }


def run_attributes(span: RunSpan) -> dict[str, str | int]:
    return {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.partition.id": str(span.partition),
        "stepstream.workflow": span.workflow,
        "stepstream.version": span.version,
        "stepstream.instance_id": span.instance_id,
        "stepstream.outcome": span.outcome,
    }


def trace_id_of_run(instance_id: str, start_ms: int) -> int:
    """For a run started without trace context: one trace per instance all the same."""
    digest = hashlib.blake2b(f"trace\0{instance_id}\0{start_ms}".encode(), digest_size=16)
    return int.from_bytes(digest.digest(), "big") or 1


def run_parent(span: StepSpan) -> SpanContext:
    """The run span a step attempt's span belongs under: made when the run ends, its
    ids computed here the same way."""
    client = client_context(span.traceparent, span.tracestate)
    run_start = span.run_start_ms
    return SpanContext(
        trace_id=client.trace_id if client else trace_id_of_run(span.instance_id, run_start),
        span_id=run_span_id(span.instance_id, run_start),
        is_remote=True,
        trace_flags=client.trace_flags if client else TraceFlags(TraceFlags.SAMPLED),
        trace_state=client.trace_state if client else TraceState(),
    )


def _ns(ms: int) -> int:
    return ms * 1_000_000


class OtelSpans:
    """A ``SpanSink`` for OpenTelemetry."""

    def __init__(self, provider: TracerProvider) -> None:
        self._tracer = provider.get_tracer(_TRACER_NAME)

    def step(self, span: StepSpan) -> None:
        otel = self._tracer.start_span(
            f"step {span.step}",
            context=trace.set_span_in_context(NonRecordingSpan(run_parent(span))),
            kind=SpanKind.INTERNAL,
            start_time=_ns(span.start_ms),
            attributes=step_attributes(span),
        )
        if span.error_type:
            otel.set_status(Status(StatusCode.ERROR, f"{span.error_type}: {span.error_message}"))
        otel.end(end_time=_ns(span.end_ms))

    def run(self, span: RunSpan) -> None:
        client = client_context(span.traceparent, span.tracestate)
        token = _next_span_id.set(run_span_id(span.instance_id, span.start_ms))
        root = _next_trace_id.set(
            None if client else trace_id_of_run(span.instance_id, span.start_ms)
        )
        try:
            otel = self._tracer.start_span(
                f"process {span.workflow}",
                context=(
                    trace.set_span_in_context(NonRecordingSpan(client)) if client else Context()
                ),
                kind=SpanKind.CONSUMER,
                start_time=_ns(span.start_ms),
                attributes=run_attributes(span),
            )
        finally:
            _next_span_id.reset(token)
            _next_trace_id.reset(root)
        if span.outcome == "failed":
            otel.set_status(Status(StatusCode.ERROR, f"{span.error_type}: {span.error_message}"))
        otel.end(end_time=_ns(span.end_ms))


@dataclass
class ServingTracing:
    """Tracing of a serving process: the global provider (producer spans of the commands
    its API publishes) and the process that makes and exports the engine's spans."""

    provider: TracerProvider
    exporter: SpanExportProcess

    def close(self) -> None:
        trace_context.produce_spans_with(None)
        self.exporter.close()
        self.provider.shutdown()  # exports the spans still batched


def from_env(*, service: str) -> ServingTracing | None:
    """Tracing for a serving process, from its environment; None when off."""
    provider = provider_from_env(os.environ, service=service)
    if provider is None:
        return None
    log.info(
        "tracing on: spans for workflow runs and step attempts (service %s)",
        provider.resource.attributes.get(SERVICE_NAME, service),
    )
    exporter = SpanExportProcess(service)
    sampler = os.environ.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler in ("", "parentbased_always_on"):
        # The commands this process publishes (its API's) get producer spans made as
        # tuples and exported by the same process; another sampler decides by the SDK.
        trace_context.produce_spans_with(exporter)
    return ServingTracing(provider, exporter)


def setup(host: PartitionHost, *, service: str) -> ServingTracing | None:
    """``from_env``, its spans made of ``host``'s runs and step attempts."""
    tracing = from_env(service=service)
    if tracing is not None:
        host.telemetry.spans = tracing.exporter
    return tracing
