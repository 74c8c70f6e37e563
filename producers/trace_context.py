"""W3C trace context for the commands a client publishes.

A start or an event sent from inside a span of the caller's (any OpenTelemetry-
instrumented code) carries that trace: the client opens a producer span named after
OpenTelemetry's messaging conventions (``send <destination>``) and puts its
``traceparent``/``tracestate`` into the command's Avro envelope (and, on Kafka, into the
record headers). Workers' spans for the run and its step attempts join that trace.

Without an OpenTelemetry SDK configured in the client's process the span records
nothing, but an active parent's context still propagates. Without either, commands carry
no trace context and cost nothing more.

A stepstream serving process (``stepstream dev``, a worker) whose spans go through its
span exporter process hands its producer spans there too (``produce_spans_with``): the
same span, ids and attributes, made as a tuple (about 3 µs) rather than an SDK span
exported from the serving process (about 100 µs with the OTLP encoding).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple, Protocol

from opentelemetry import context, trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER_NAME = "stepstream.client"
log = logging.getLogger("stepstream.tracing")
_SAMPLED = 0x01


class ProducerSpan(NamedTuple):
    """The producer span of one published command, as ``sending`` made it."""

    destination: str
    instance_id: str
    operation: str
    trace_id: int
    span_id: int
    parent_span_id: int  # 0: a root span
    remote_parent: bool
    tracestate: str | None
    start_ns: int
    end_ns: int
    error: str | None


class ProducerSink(Protocol):
    def producer(self, span: ProducerSpan) -> None: ...


_sink: ProducerSink | None = None


def produce_spans_with(sink: ProducerSink | None) -> None:
    """Make this process's producer spans as ``ProducerSpan`` tuples handed to ``sink``
    (None: back to the OpenTelemetry tracer). Only for a sampler that follows the
    parent's flag and samples roots, OpenTelemetry's default: ``sending`` decides so."""
    global _sink
    _sink = sink


@contextmanager
def sending(
    destination: str, instance_id: str, operation: str
) -> Iterator[tuple[str | None, str | None]]:
    """A producer span around publishing one command; yields the (traceparent,
    tracestate) to put into it, (None, None) when there is no trace to join."""
    sink = _sink
    if sink is not None:
        with _sending_to(sink, destination, instance_id, operation) as trace_context:
            yield trace_context
        return
    if not trace.get_current_span().get_span_context().is_valid and isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider
    ):
        # No SDK in this process and no trace to join: the span would record nothing and
        # carry no context. Skipping it saves most of a start's tracing cost (~25 µs).
        yield None, None
        return
    tracer = trace.get_tracer(_TRACER_NAME)
    with tracer.start_as_current_span(
        f"send {destination}",
        kind=SpanKind.PRODUCER,
        attributes=producer_attributes(destination, instance_id, operation),
    ) as span:
        if not span.get_span_context().is_valid:
            yield None, None
            return
        yield current()


def producer_attributes(destination: str, instance_id: str, operation: str) -> dict[str, str]:
    """A command's producer span's attributes (OpenTelemetry's messaging conventions)."""
    return {
        "messaging.system": "kafka",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": destination,
        "messaging.kafka.message.key": instance_id,
        "stepstream.command": operation,
        "stepstream.instance_id": instance_id,
    }


@contextmanager
def _sending_to(
    sink: ProducerSink, destination: str, instance_id: str, operation: str
) -> Iterator[tuple[str | None, str | None]]:
    # The block only publishes the command, which carries the span's context: nothing
    # in it reads the current span, so the span is not made current (a cost per command).
    parent = trace.get_current_span().get_span_context()
    span_id = random.getrandbits(64) or 1
    if parent.is_valid:
        trace_id, flags = parent.trace_id, int(parent.trace_flags) & _SAMPLED
        header = parent.trace_state.to_header() or None
    else:
        trace_id, flags, header = random.getrandbits(128) or 1, _SAMPLED, None
    start = time.time_ns()
    error: str | None = None
    try:
        yield f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}", header
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if flags & _SAMPLED:
            _hand_over(
                sink,
                ProducerSpan(
                    destination,
                    instance_id,
                    operation,
                    trace_id,
                    span_id,
                    parent.span_id if parent.is_valid else 0,
                    parent.is_remote if parent.is_valid else False,
                    header,
                    start,
                    time.time_ns(),
                    error,
                ),
            )


def _hand_over(sink: ProducerSink, span: ProducerSpan) -> None:
    """A span never changes how the publish it describes ended."""
    try:
        sink.producer(span)
    except Exception:
        log.warning("a producer span could not be handed to the span exporter", exc_info=True)


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
def in_no_trace() -> Iterator[None]:
    """Run the block outside any trace (an empty context): what it publishes starts a
    trace of its own, whatever context the surrounding code runs in."""
    token = context.attach(context.Context())
    try:
        yield
    finally:
        context.detach(token)


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
