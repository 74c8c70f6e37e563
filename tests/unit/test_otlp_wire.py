"""The hand-encoded OTLP requests (``ops/telemetry/otlp_wire.py``) say what the SDK's encoder says
for the same runs and attempts: decoded with the OTLP protobuf classes, they match."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, TraceIdRatioBased

from stepstream.consumers.spans import ActivationSpan, StepSpan
from stepstream.engine.wire.run_trace import run_span_id
from stepstream.ops.telemetry.otlp_wire import SpanEncoder, parse_traceparent
from stepstream.ops.telemetry.span_direct import DirectSpans
from stepstream.producers import trace_context
from stepstream.producers.trace_context import ProducerSpan

REPO = Path(__file__).resolve().parents[2]
KAFKA = trace_context.Destination("kafka", "shop.commands")

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def _step(**changes: Any) -> StepSpan:
    span = StepSpan(
        workflow="orders",
        instance_id="o-1",
        partition=3,
        key="charge#2",
        step="charge",
        attempt=2,
        start_ms=1_700_000_000_123,
        end_ms=1_700_000_000_456,
        outcome="succeeded",
        error_type="",
        error_message="",
        traceparent=CLIENT,
        tracestate="vendor=1,other=x",
        run_start_ms=1_700_000_000_000,
        stacktrace="",
    )
    return span._replace(**changes)


def _activation(**changes: Any) -> ActivationSpan:
    span = ActivationSpan(
        workflow="orders",
        version="2",
        instance_id="o-1",
        partition=3,
        start_ns=1_700_000_000_000_000_123,
        end_ns=1_700_000_001_000_000_456,
        run_start_ms=1_700_000_000_000,
        first=True,
        inputs="StartWorkflow",
        command_id="c-1",
        offset=42,
        commands=1,
        status="running",
        error_type="",
        error_message="",
        stacktrace="",
        traceparent=CLIENT,
        tracestate="vendor=1,other=x",
        links=(),
        system="kafka",
        destination="shop.commands",
        group="shop.workers",
    )
    return span._replace(**changes)


def _producer(**changes: Any) -> ProducerSpan:
    span = ProducerSpan(
        system="kafka",
        destination="shop.commands",
        partition=5,
        instance_id="o-1",
        operation="StartWorkflow",
        command_id="c-1",
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0x00F067AA0BA902B7,
        parent_span_id=0xB7AD6B7169203331,
        remote_parent=True,
        tracestate="vendor=1",
        start_ns=1_700_000_000_000_000_123,
        end_ns=1_700_000_000_002_000_456,
        error=None,
    )
    return span._replace(**changes)


SPANS = [
    _step(),
    _step(outcome="failed", error_type="ValueError", error_message="bad card ✗", attempt=1),
    _step(
        outcome="retried",
        error_type="KeyError",
        error_message="'x'",
        stacktrace="Traceback (most recent call last):\n" + "  frame\n" * 40 + "KeyError: 'x'\n",
    ),
    _step(traceparent=None, tracestate=None),
    _activation(),
    _activation(
        traceparent=None,
        tracestate=None,
        first=False,
        inputs="StepOutcome",
        command_id="",
        offset=-1,
        commands=0,
        status="failed",
        error_type="E",
        error_message="m",
        stacktrace="Traceback ...\nE: m\n",
    ),
    _activation(workflow="négoce", instance_id="ü/1", system="", destination="", group=""),
    _activation(
        first=False,
        inputs="SendEvent,SendEvent",
        commands=2,
        links=(
            (UNSAMPLED, None),
            ("00-" + "1" * 32 + "-" + "2" * 16 + "-01", "k=v"),
            ("bad", None),
        ),
    ),
    _producer(),
    _producer(parent_span_id=0, remote_parent=False, tracestate=None, error="Boom: no"),
    _producer(remote_parent=False, operation="SendEvent", partition=-1),
    _producer(system="", destination="", partition=-1, operation="PauseWorkflow"),
]


RUN_SPAN_IDS = {
    base64.b64encode(run_span_id(instance_id, 1_700_000_000_000).to_bytes(8, "big")).decode()
    for instance_id in ("o-1", "ü/1")
} | {
    base64.b64encode(span.span_id.to_bytes(8, "big")).decode()
    for span in SPANS
    if isinstance(span, ProducerSpan)
}


class _Keep(SpanProcessor):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def _decoded(data: bytes) -> dict[str, Any]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(data)
    decoded = MessageToDict(request)
    for resource_spans in decoded["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                if span["kind"] == "SPAN_KIND_INTERNAL" or span["spanId"] not in RUN_SPAN_IDS:
                    # A step attempt's span id is random, and so is that of an activation
                    # other than the run's first (which is the run span).
                    span["spanId"] = "random"
    return decoded


def test_the_hand_encoded_request_decodes_as_the_sdk_encodes_the_same_spans() -> None:
    resource = Resource.create({"service.name": "stepstream-test", "deployment": "x"})
    keep = _Keep()
    sdk = DirectSpans(keep, resource, TracerProvider().sampler)
    sdk.batch(SPANS)
    expected = _decoded(encode_spans(keep.spans).SerializeToString())

    data, count = SpanEncoder(resource.attributes).request(SPANS)
    assert count == len(SPANS)
    assert _decoded(data) == expected


def test_spans_under_an_unsampled_client_span_are_dropped_by_the_default_sampler() -> None:
    encoder = SpanEncoder({"service.name": "s"})
    spans = [
        _step(traceparent=UNSAMPLED),
        _activation(traceparent=UNSAMPLED),
        _activation(traceparent=UNSAMPLED, first=False),
        _activation(),
    ]
    assert encoder.request(spans)[1] == 1
    # An SDK sampler from OTEL_TRACES_SAMPLER decides when one is set.
    assert SpanEncoder({}, ALWAYS_OFF).request(spans)[1] == 0
    ratio = SpanEncoder({}, TraceIdRatioBased(1.0)).request(spans)[1]
    assert ratio == 4  # a ratio sampler ignores the parent's flag


def test_a_malformed_traceparent_is_no_parent() -> None:
    assert parse_traceparent(CLIENT, None) is not None
    for bad in ("", "00-xyz", "00-" + "0" * 32 + "-b7ad6b7169203331-01", "ff-" + CLIENT[3:]):
        assert parse_traceparent(bad, None) is None
    # A run whose start carried garbage is a root span of its own trace, not lost.
    data, count = SpanEncoder({}).request([_activation(traceparent="garbage")])
    assert count == 1 and "parentSpanId" not in str(_decoded(data))


def test_the_exporter_process_takes_the_hand_encoded_path_for_otlp_over_http() -> None:
    """The fast path leans on the OTLP exporter's HTTP client: with the version the
    project installs, it is taken; anything but OTLP over HTTP goes the SDK's way."""
    from stepstream.ops.telemetry.otlp_wire import WireExport, wire_from_env

    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert isinstance(wire_from_env(endpoint, service="s"), WireExport)
    assert wire_from_env({**endpoint, "OTEL_TRACES_EXPORTER": "console"}, service="s") is None
    grpc = {**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert wire_from_env(grpc, service="s") is None
    assert wire_from_env({}, service="s") is None  # tracing off


def test_a_flushed_batch_reads_back_whole_and_in_order() -> None:
    """What a flush puts on the queue to the exporter process (one flat, marshalled
    batch) is what that process reads back: every span, its kind, every field, in order."""
    import marshal

    from stepstream.ops.telemetry import span_export

    exporter = span_export.SpanExportProcess("s")  # tracing off here: the child just ends
    put: list[bytes] = []
    real_queue = exporter._queue
    try:
        exporter._queue = type("Q", (), {"put": staticmethod(put.append)})()
        spans = [
            _step(),
            _activation(),
            _producer(),
            _step(attempt=2, error_type="Boom"),
            _activation(links=((CLIENT, None),)),
        ]
        hand_over: dict[type, Any] = {
            StepSpan: exporter.step,
            ActivationSpan: exporter.activation,
            ProducerSpan: exporter.producer,
        }
        for span in spans:
            hand_over[type(span)](span)
        exporter.flush()
        (data,) = put
        read_back = span_export._spans(marshal.loads(data))
        assert read_back == spans
        assert [type(s) for s in read_back] == [type(s) for s in spans]
        assert exporter._batch == [] and exporter._count == 0
    finally:
        exporter._queue = real_queue
        exporter.close()


def test_the_engines_flat_spans_reach_the_exporter_process_field_for_field() -> None:
    """A commit's spans as the engine hands them over (``spans_flat``: flat tuples that
    fold a run's fields, an unfailed span's error fields, a read command and the
    messaging system into one value each) are, once marshalled and read back by the
    exporter process, the named spans they were made from, failures and links included."""
    import marshal

    from stepstream.consumers.spans import flat_activation, flat_step, named
    from stepstream.ops.telemetry import span_export

    named_spans = [s for s in SPANS if not isinstance(s, ProducerSpan)]
    flats = [flat_step(s) if isinstance(s, StepSpan) else flat_activation(s) for s in named_spans]
    assert [named(f) for f in flats] == named_spans
    assert len(flats[0]) < len(named_spans[0]) + 1  # folded, not the fields one by one
    exporter = span_export.SpanExportProcess("s")  # tracing off here: the child just ends
    put: list[bytes] = []
    real_queue = exporter._queue
    try:
        exporter._queue = type("Q", (), {"put": staticmethod(put.append)})()
        exporter.spans_flat(flats[:3])
        exporter.spans_flat(flats[3:])
        exporter.flush()
        (data,) = put
        read_back = span_export._spans(marshal.loads(data))
        assert read_back == named_spans
        assert [type(s) for s in read_back] == [type(s) for s in named_spans]
    finally:
        exporter._queue = real_queue
        exporter.close()


def test_the_exporter_process_says_it_is_ready_even_with_tracing_off() -> None:
    from stepstream.ops.telemetry import span_export

    exporter = span_export.SpanExportProcess("s")
    try:
        assert exporter.wait_ready(30.0)
    finally:
        exporter.close()


def test_an_exporter_that_falls_behind_drops_whole_batches_and_says_so(
    caplog: Any,
) -> None:
    from stepstream.ops.telemetry import span_export

    exporter = span_export.SpanExportProcess("s")  # tracing off here: the child just ends
    try:
        exporter._sent = span_export.MAX_BACKLOG  # as if the child took none of them
        exporter.step(_step())
        exporter.activation(_activation())
        exporter.flush()
        assert exporter.dropped == 2
        assert exporter.spans_dropped() == {"backlog": 2, "export_failed": 0}
        assert "spans dropped" in caplog.text
    finally:
        exporter.close()


class _Sink:
    def __init__(self) -> None:
        self.spans: list[ProducerSpan] = []

    def producer(self, span: ProducerSpan) -> None:
        self.spans.append(span)


def test_a_serving_process_makes_its_producer_spans_as_tuples_in_the_callers_trace() -> None:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    sink = _Sink()
    trace_context.produce_spans_with(sink)
    try:
        with trace_context.sending(KAFKA, "o-1", "StartWorkflow", "c", 0) as (tp, ts):
            pass
        (root,) = sink.spans
        assert tp == f"00-{root.trace_id:032x}-{root.span_id:016x}-01" and ts is None
        assert root.parent_span_id == 0 and root.end_ns >= root.start_ns

        caller = SpanContext(0xABC, 0xDEF, True, TraceFlags(TraceFlags.SAMPLED))
        with trace.use_span(NonRecordingSpan(caller)):
            with trace_context.sending(KAFKA, "o-2", "SendEvent", "c", 0) as (tp, _):
                pass
        child = sink.spans[-1]
        assert (child.trace_id, child.parent_span_id, child.remote_parent) == (0xABC, 0xDEF, True)
        assert tp == f"00-{0xABC:032x}-{child.span_id:016x}-01"

        unsampled = SpanContext(0xABC, 0xDEF, True, TraceFlags(0))
        with trace.use_span(NonRecordingSpan(unsampled)):
            with trace_context.sending(KAFKA, "o-3", "SendEvent", "c", 0) as (tp, _):
                pass
        assert len(sink.spans) == 2 and tp is not None and tp.endswith("-00")

        try:
            with trace_context.sending(KAFKA, "o-4", "StartWorkflow", "c", 0):
                raise ValueError("refused")
        except ValueError:
            pass
        assert sink.spans[-1].error == "ValueError: refused"
    finally:
        trace_context.produce_spans_with(None)


def test_without_an_sdk_a_command_carries_the_callers_trace_or_none() -> None:
    """In a process with no OpenTelemetry SDK (a fresh interpreter: tests here may have
    set a tracer provider), a command sent inside the caller's span carries that span's
    context, and one sent outside any span carries none."""
    script = """
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from stepstream.producers import trace_context
KAFKA = trace_context.Destination("kafka", "shop.commands")
assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
with trace_context.sending(KAFKA, "o-1", "StartWorkflow", "c", 0) as carried:
    print(carried)
caller = SpanContext(0xABC, 0xDEF, True, TraceFlags(TraceFlags.SAMPLED))
with trace.use_span(NonRecordingSpan(caller)):
    with trace_context.sending(KAFKA, "o-2", "SendEvent", "c", 0) as carried:
        print(carried)
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    none, joined = done.stdout.splitlines()
    assert none == "(None, None)"
    assert joined == f"('00-{0xABC:032x}-{0xDEF:016x}-01', None)"
