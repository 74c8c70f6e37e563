"""What each of stepstream's spans is: its name, parent, attributes, links and events,
after OpenTelemetry's semantic conventions for messaging and for exceptions, with the
attribute names of the installed ``opentelemetry-semantic-conventions``.

``ops/telemetry/span_direct.py`` makes SDK spans of these; ``ops/telemetry/otlp_wire.py``
encodes the same spans by hand (``tests/unit/test_otlp_wire.py`` holds the two equal), so
an attribute added here is added there in the same order.

The messaging attributes are set only where a messaging system carries the commands
(Kafka: ``messaging.system=kafka``). The embedded engine's log is no messaging system:
its spans (and those of the HTTP API, which publishes to it) carry stepstream's own
attributes only, as the conventions apply to messaging systems.
"""

from __future__ import annotations

import functools

from opentelemetry import trace
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
from opentelemetry.trace import SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from stepstream.consumers.spans import ActivationSpan, StepSpan
from stepstream.engine.version import version
from stepstream.engine.wire.run_trace import run_span_id, trace_id_of_run

SCOPE = "stepstream.worker"  # the workers' spans: activations and step attempts
CLIENT_SCOPE = "stepstream.client"  # the producer spans of published commands
EXCEPTION = "exception"  # the exception event's name
PROCESS = "process"  # messaging.operation.type and .name of an activation
_PROPAGATOR = TraceContextTextMapPropagator()

Attributes = dict[str, str | int]


@functools.cache
def scope_version() -> str:
    """The instrumentation scope's version: stepstream's (``stepstream.__version__``)."""
    return version()


def client_context(traceparent: str | None, tracestate: str | None) -> SpanContext | None:
    """The span a run's start (or another input) carried, if any and well formed."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    parent = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    return parent if parent.is_valid else None


def run_context(
    instance_id: str, run_start_ms: int, traceparent: str | None, tracestate: str | None
) -> SpanContext:
    """The run span (its first activation) as the parent of the run's other spans: its
    ids computed from the instance, wherever and whenever they are made."""
    client = client_context(traceparent, tracestate)
    return SpanContext(
        trace_id=client.trace_id if client else trace_id_of_run(instance_id, run_start_ms),
        span_id=run_span_id(instance_id, run_start_ms),
        is_remote=True,
        trace_flags=client.trace_flags if client else TraceFlags(TraceFlags.SAMPLED),
        trace_state=client.trace_state if client else TraceState(),
    )


def step_name(span: StepSpan) -> str:
    return f"step {span.step}"


def step_attributes(span: StepSpan) -> Attributes:
    return {
        "stepstream.workflow": span.workflow,
        "stepstream.step": span.step,
        "stepstream.step.key": span.key,
        "stepstream.attempt": span.attempt,
        "stepstream.instance_id": span.instance_id,
        "stepstream.outcome": span.outcome,
        "stepstream.partition": span.partition,
    }


def activation_name(span: ActivationSpan) -> str:
    """``process <topic>`` (the messaging conventions' name) on Kafka; else
    ``process <workflow>``."""
    return f"{PROCESS} {span.destination or span.workflow}"


def activation_attributes(span: ActivationSpan) -> Attributes:
    attributes: Attributes = {}
    if span.system:
        attributes[MESSAGING_SYSTEM] = span.system
        attributes[MESSAGING_OPERATION_TYPE] = PROCESS
        attributes[MESSAGING_OPERATION_NAME] = PROCESS
        attributes[MESSAGING_DESTINATION_NAME] = span.destination
        attributes[MESSAGING_CONSUMER_GROUP_NAME] = span.group
        attributes[MESSAGING_DESTINATION_PARTITION_ID] = str(span.partition)
        if span.commands:
            attributes[MESSAGING_MESSAGE_ID] = span.command_id
            attributes[MESSAGING_KAFKA_OFFSET] = span.offset
            attributes[MESSAGING_KAFKA_MESSAGE_KEY] = span.instance_id
        if span.commands > 1:
            attributes[MESSAGING_BATCH_MESSAGE_COUNT] = span.commands
    attributes["stepstream.workflow"] = span.workflow
    attributes["stepstream.version"] = span.version
    attributes["stepstream.instance_id"] = span.instance_id
    attributes["stepstream.partition"] = span.partition
    attributes["stepstream.inputs"] = span.inputs
    attributes["stepstream.status"] = span.status
    return attributes


def exception_attributes(error_type: str, message: str, stacktrace: str) -> Attributes:
    """The ``exception`` event's attributes (the exception conventions)."""
    attributes: Attributes = {EXCEPTION_TYPE: error_type, EXCEPTION_MESSAGE: message}
    if stacktrace:
        attributes[EXCEPTION_STACKTRACE] = stacktrace
    return attributes


def error_description(error_type: str, message: str) -> str:
    """An ERROR status's description."""
    return f"{error_type}: {message}"


def links(span: ActivationSpan) -> list[SpanContext]:
    """The spans that sent what the activation processed from other traces (an event's
    send): well-formed contexts only."""
    found = []
    for traceparent, tracestate in span.links:
        context = client_context(traceparent, tracestate)
        if context is not None:
            found.append(context)
    return found
