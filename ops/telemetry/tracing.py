"""OpenTelemetry traces of a serving process: a span for each activation of a workflow
run and for each step attempt, joined to the trace the client's start carried.

Spans are made from durable records when a commit makes them so (``Telemetry`` feeds a
``SpanSink``), with the times the records and the commit hold. An activation is the
instance driven by the inputs one commit applied to it (a start, an event, a timer, a
step's outcome, a cancel or a pause): one span each, all in the run's trace, rather than
one span open for the days a run may sleep. The first activation is the run span, its id
derived from the instance (``engine/wire/run_trace.py``), so the spans of later
activations, of step attempts and of child runs, made anywhere and later, name it as
their parent. What each span holds: ``ops/telemetry/span_attributes.py``; the list:
docs/operations.md.

Configured by OpenTelemetry's standard variables. Tracing is on when an exporter is
named (``OTEL_TRACES_EXPORTER=otlp|console``) or an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), and off with
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``. ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and the OTLP exporter's own
variables apply as usual. Off, the engine makes no span and records nothing for them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from stepstream.consumers.host import PartitionHost
from stepstream.ops.telemetry.span_export import SpanExportProcess
from stepstream.producers import trace_context

if TYPE_CHECKING:
    from stepstream.ops.telemetry.span_direct import DirectSpans

log = logging.getLogger("stepstream.tracing")


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
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(name, "").strip().lower()
        if protocol and protocol != "http/protobuf":
            log.warning(
                "only OTLP over HTTP (http/protobuf) is sent: spans go that way to the "
                "endpoint, which must take it (a collector's port 4318, not gRPC's 4317)",
                extra={name.lower(): protocol},
            )
            break
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
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter_from_env(env)))
    if install_global:
        trace.set_tracer_provider(provider)
    return provider


def install(host: PartitionHost, provider: TracerProvider) -> DirectSpans:
    """Make ``host``'s activations and step attempts into spans of ``provider`` (its
    resource, sampler and span processors), in this process."""
    from stepstream.ops.telemetry.span_direct import DirectSpans

    # The provider's processors, all of them, as one: what its tracers' spans end into.
    processor = provider._active_span_processor
    spans = DirectSpans(processor, provider.resource, provider.sampler)
    host.telemetry.spans = spans
    return spans


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
