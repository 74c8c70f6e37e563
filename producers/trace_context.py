"""W3C trace context for the commands a client publishes.

Every command a client publishes (start, event, cancel, pause, resume, and any other:
``CommandPublisher._submit`` makes the span) carries the trace of the caller's span, if
any (any OpenTelemetry-instrumented code): the client opens a producer span after
OpenTelemetry's messaging conventions (``send <topic>`` on Kafka; ``send <command>``
where no messaging system carries it, embedded or through the HTTP API) and puts its
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
from opentelemetry.semconv._incubating.attributes.messaging_attributes import (
    MESSAGING_DESTINATION_NAME,
    MESSAGING_DESTINATION_PARTITION_ID,
    MESSAGING_KAFKA_MESSAGE_KEY,
    MESSAGING_MESSAGE_ID,
    MESSAGING_OPERATION_NAME,
    MESSAGING_OPERATION_TYPE,
    MESSAGING_SYSTEM,
)
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER_NAME = "stepstream.client"
log = logging.getLogger("stepstream.tracing")
_SAMPLED = 0x01


class Destination(NamedTuple):
    """Where a transport publishes commands, for its producer spans."""

    system: str  # "kafka"; "" where no messaging system carries them (embedded, HTTP)
    name: str  # the commands topic ("<prefix>.commands"); "" without a messaging system


# The embedded engine's own log, in process (also the API's, for its HTTP clients).
IN_PROCESS = Destination("", "")


class ProducerSpan(NamedTuple):
    """The producer span of one published command, as ``sending`` made it."""

    system: str
    destination: str
    partition: int  # -1: not known when it was sent (no messaging system)
    instance_id: str
    operation: str
    command_id: str
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


def version() -> str:
    """stepstream's version, the instrumentation scope's (read once)."""
    global _version
    if _version is None:
        from stepstream.engine.version import version as installed

        _version = installed()
    return _version


_version: str | None = None


@contextmanager
def sending(
    destination: Destination, instance_id: str, operation: str, command_id: str, partition: int
) -> Iterator[tuple[str | None, str | None]]:
    """A producer span around publishing one command; yields the (traceparent,
    tracestate) to put into it, (None, None) when there is no trace to join."""
    sink = _sink
    if sink is not None:
        with _sending_to(
            sink, destination, instance_id, operation, command_id, partition
        ) as trace_context:
            yield trace_context
        return
    if not trace.get_current_span().get_span_context().is_valid and isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider
    ):
        # No SDK in this process and no trace to join: the span would record nothing and
        # carry no context. Skipping it saves most of a start's tracing cost (~25 µs).
        yield None, None
        return
    tracer = trace.get_tracer(_TRACER_NAME, version())
    with tracer.start_as_current_span(
        producer_name(destination.name, operation),
        kind=SpanKind.PRODUCER,
        attributes=producer_attributes(
            destination.system, destination.name, partition, instance_id, operation, command_id
        ),
    ) as span:
        if not span.get_span_context().is_valid:
            yield None, None
            return
        yield current()


def producer_name(destination: str, operation: str) -> str:
    """``send <topic>`` as the messaging conventions name it; without a messaging system,
    ``send <command>``."""
    return f"send {destination or operation}"


def producer_attributes(
    system: str,
    destination: str,
    partition: int,
    instance_id: str,
    operation: str,
    command_id: str,
) -> dict[str, str]:
    """A command's producer span's attributes: OpenTelemetry's messaging conventions
    where a messaging system (Kafka) carries the command, and stepstream's own."""
    attributes = {}
    if system:
        attributes = {
            MESSAGING_SYSTEM: system,
            MESSAGING_OPERATION_TYPE: "send",
            MESSAGING_OPERATION_NAME: "send",
            MESSAGING_DESTINATION_NAME: destination,
        }
        if partition >= 0:
            attributes[MESSAGING_DESTINATION_PARTITION_ID] = str(partition)
        attributes[MESSAGING_KAFKA_MESSAGE_KEY] = instance_id
        attributes[MESSAGING_MESSAGE_ID] = command_id
    attributes["stepstream.command"] = operation
    attributes["stepstream.instance_id"] = instance_id
    return attributes


@contextmanager
def _sending_to(
    sink: ProducerSink,
    destination: Destination,
    instance_id: str,
    operation: str,
    command_id: str,
    partition: int,
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
                    destination.system,
                    destination.name,
                    partition,
                    instance_id,
                    operation,
                    command_id,
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
