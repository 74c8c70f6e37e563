"""W3C trace context for the commands a client publishes.

A start or an event sent from inside a span of the caller's (any OpenTelemetry-
instrumented code) carries that trace: the client opens a producer span named after
OpenTelemetry's messaging conventions (``send <destination>``) and puts its
``traceparent``/``tracestate`` into the command's Avro envelope (and, on Kafka, into the
record headers). Workers' spans for the run and its step attempts join that trace.

Without an OpenTelemetry SDK configured in the client's process the span records
nothing, but an active parent's context still propagates. Without either, commands carry
no trace context and cost nothing more.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context, trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER_NAME = "stepstream.client"


@contextmanager
def sending(
    destination: str, instance_id: str, operation: str
) -> Iterator[tuple[str | None, str | None]]:
    """A producer span around publishing one command; yields the (traceparent,
    tracestate) to put into it, (None, None) when there is no trace to join."""
    tracer = trace.get_tracer(_TRACER_NAME)
    with tracer.start_as_current_span(
        f"send {destination}",
        kind=SpanKind.PRODUCER,
        attributes={
            "messaging.system": "kafka",
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "messaging.destination.name": destination,
            "messaging.kafka.message.key": instance_id,
            "stepstream.command": operation,
            "stepstream.instance_id": instance_id,
        },
    ) as span:
        if not span.get_span_context().is_valid:
            yield None, None
            return
        yield current()


def current() -> tuple[str | None, str | None]:
    """The active span's (traceparent, tracestate), or (None, None)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent"), carrier.get("tracestate")


def record_headers(
    traceparent: str | None, tracestate: str | None
) -> list[tuple[str, str | bytes | None]] | None:
    """A command's trace context as Kafka record headers (the envelope carries it too),
    for tracing-aware Kafka tools; None without one."""
    if not traceparent:
        return None
    found: list[tuple[str, str | bytes | None]] = [("traceparent", traceparent.encode())]
    if tracestate:
        found.append(("tracestate", tracestate.encode()))
    return found


def headers() -> dict[str, str]:
    """The active trace context as HTTP headers (empty without one)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


@contextmanager
def joined(carrier: Mapping[str, str]) -> Iterator[None]:
    """Run the block inside the trace context ``carrier`` names (HTTP headers of a
    request); a carrier without ``traceparent`` changes nothing."""
    if "traceparent" not in carrier:
        yield
        return
    token = context.attach(_PROPAGATOR.extract(dict(carrier)))
    try:
        yield
    finally:
        context.detach(token)
