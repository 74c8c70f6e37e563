"""OpenTelemetry: a start made inside a caller's span carries its W3C trace context, and
the worker's spans for the run and each step attempt join that trace, on both backends
and across a restart of the engine in the middle of a run."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from stepstream.consumers.kafka import create_topics
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.ops.telemetry import tracing
from stepstream.producers.client import Client
from tests.conftest import KAFKA_TEST_PARTITIONS, ThreadedWorker, kafka_settings, kafka_url
from tests.conftest import test_registry as registry
from tests.kafka_broker import Broker
from tests.otlp_collector import OtlpCollector as _Collector


@pytest.fixture(scope="module")
def provider() -> Iterator[TracerProvider]:
    provider = TracerProvider(id_generator=tracing.StableIds())
    # The client's producer spans use the global provider, as in an application that
    # configured OpenTelemetry; set once per process.
    trace.set_tracer_provider(provider)
    yield provider


@pytest.fixture
def exporter(provider: TracerProvider) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def _trace(exporter: InMemorySpanExporter, trace_id: int) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in exporter.get_finished_spans():
        if span.context is not None and span.context.trace_id == trace_id:
            found.setdefault(span.name, []).append(span)
    return found


def _check_one_trace(
    spans: dict[str, list[ReadableSpan]], checkout: ReadableSpan, instance_id: str
) -> None:
    """checkout (the caller) -> send (client, producer) -> process arith (worker)
    -> step add, step double (worker)."""
    assert checkout.context is not None
    (send,) = spans["send stepstream.commands"]
    assert send.kind is SpanKind.PRODUCER
    assert send.parent is not None and send.parent.span_id == checkout.context.span_id
    assert send.attributes is not None
    assert send.attributes["messaging.destination.name"] == "stepstream.commands"
    assert send.attributes["stepstream.instance_id"] == instance_id
    (run,) = spans["process arith"]
    assert run.kind is SpanKind.CONSUMER
    assert send.context is not None and run.parent is not None
    assert run.parent.span_id == send.context.span_id
    assert run.attributes is not None and run.attributes["stepstream.outcome"] == "completed"
    assert run.context is not None
    for name in ("add", "double"):
        (step,) = spans[f"step {name}"]
        assert step.parent is not None and step.parent.span_id == run.context.span_id
        attributes = step.attributes
        assert attributes is not None
        assert attributes["stepstream.workflow"] == "arith"
        assert attributes["stepstream.step"] == name
        assert attributes["stepstream.attempt"] == 1
        assert attributes["stepstream.instance_id"] == instance_id
        assert "messaging.destination.partition.id" in attributes
        assert step.start_time is not None and run.start_time is not None
        assert run.start_time <= step.start_time <= (step.end_time or 0) <= (run.end_time or 0)


async def test_embedded_run_and_steps_join_the_callers_trace(
    tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    engine = await open_embedded(
        registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    )
    tracing.install(engine.host, provider)
    app = provider.get_tracer("shop")
    async with Client(engine.make_transport(owns_engine=True)) as client:
        with app.start_as_current_span("checkout") as checkout:
            instance_id = await client.start("arith", 4)
        assert await client.result(instance_id, timeout=30) == {"total": 5, "doubled": 10}
    spans = _trace(exporter, checkout.get_span_context().trace_id)
    (caller,) = spans["checkout"]
    _check_one_trace(spans, caller, instance_id)


async def test_a_run_that_outlives_a_restart_stays_in_its_trace(
    tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    config = EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    app = provider.get_tracer("shop")
    engine = await open_embedded(registry(), config)
    tracing.install(engine.host, provider)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        with app.start_as_current_span("checkout") as checkout:
            instance_id = await client.start("waiter", None)
        await client.status(instance_id)
    # A new engine on the same data: the run ends there, after an event sent outside
    # any span of the caller's.
    engine = await open_embedded(registry(), config)
    tracing.install(engine.host, provider)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        await client.send_event(instance_id, "approval", {"ok": True})
        await client.result(instance_id, timeout=30)
    spans = _trace(exporter, checkout.get_span_context().trace_id)
    (run,) = spans["process waiter"]
    assert run.attributes is not None and run.attributes["stepstream.instance_id"] == instance_id


async def test_kafka_worker_spans_join_the_callers_trace(
    kafka_broker: Broker,
    tmp_path: Path,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    settings = kafka_settings(kafka_broker, f"t{uuid.uuid4().hex[:10]}")
    create_topics(settings, KAFKA_TEST_PARTITIONS)
    worker = ThreadedWorker(settings, tmp_path / "worker", registry(), tracer_provider=provider)
    try:
        worker.start()
        app = provider.get_tracer("shop")
        async with Client.connect(kafka_url(settings)) as client:
            with app.start_as_current_span("checkout") as checkout:
                instance_id = await client.start("arith", 1)
            assert await client.result(instance_id, timeout=30) == {"total": 2, "doubled": 4}
    finally:
        worker.stop()
    spans = _trace(exporter, checkout.get_span_context().trace_id)
    (caller,) = spans["checkout"]
    _check_one_trace(spans, caller, instance_id)
    # The start on the commands topic carries the trace in its headers, as any
    # tracing-aware Kafka tool expects, and in its Avro envelope.
    headers, envelope = _start_record(settings, instance_id)
    trace_hex = format(checkout.get_span_context().trace_id, "032x")
    assert headers["traceparent"].decode() == envelope
    assert envelope.split("-")[1] == trace_hex


def _start_record(settings: Any, instance_id: str) -> tuple[dict[str, bytes], str]:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from stepstream.engine.wire.records import StartWorkflow
    from stepstream.engine.wire.serde import default_serde
    from stepstream.engine.wire.topics import partition_for

    topic = f"{settings.prefix}.commands"
    consumer = Consumer({"bootstrap.servers": settings.bootstrap, "group.id": "t-read"})
    try:
        partition = partition_for(instance_id, KAFKA_TEST_PARTITIONS)
        consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)])
        for _ in range(100):
            msg = consumer.poll(5)
            assert msg is not None, f"no StartWorkflow for {instance_id} on {topic}"
            if msg.error() is not None or msg.key() != instance_id.encode():
                continue
            record = default_serde().decode(msg.value() or b"")
            if isinstance(record, StartWorkflow):
                assert record.traceparent is not None
                return dict(msg.headers() or []), record.traceparent
        raise AssertionError(f"no StartWorkflow for {instance_id} on {topic}")
    finally:
        consumer.close()


async def test_dev_exports_run_and_step_spans_over_otlp_in_the_callers_trace(
    tmp_path: Path, provider: TracerProvider
) -> None:
    """The production path: `stepstream dev` configured by OTEL_* variables, its spans
    made by the exporter process and sent over OTLP/HTTP to a collector."""
    from tests.dev_server import clean_env, start_dev

    collector = _Collector()
    env = clean_env(
        tmp_path,
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        OTEL_SERVICE_NAME="shop",
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    source = "from tests.workflows import arith  # noqa: F401\n"
    server = start_dev(tmp_path, "traced", source, env=env)
    try:
        async with Client.connect(server.url) as client:
            with provider.get_tracer("shop").start_as_current_span("checkout") as checkout:
                instance_id = await client.start("arith", 1)
            assert await client.result(instance_id, timeout=30) == {"total": 2, "doubled": 4}
    finally:
        server.stop()  # the exporter process flushes on the way out
        collector.close()
    # The log names the service the spans are exported under: OTEL_SERVICE_NAME's.
    assert "tracing on: spans for workflow runs and step attempts (service shop)" in (
        server.log.read_text()
    )
    trace_id = checkout.get_span_context().trace_id.to_bytes(16, "big")
    names = sorted(span.name for span in collector.spans if span.trace_id == trace_id)
    assert names == ["process arith", "send stepstream.commands", "step add", "step double"]
    run = next(span for span in collector.spans if span.name == "process arith")
    for step in (span for span in collector.spans if span.name.startswith("step ")):
        assert step.parent_span_id == run.span_id


async def test_spans_an_endpoint_refuses_are_counted_on_metrics(tmp_path: Path) -> None:
    """An OTLP endpoint that refuses every export (HTTP 400, which the exporter does
    not retry): the runs still complete, and ``/metrics`` counts the spans lost."""
    import aiohttp

    from tests.dev_server import clean_env, start_dev

    collector = _Collector(status=400)
    env = clean_env(
        tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=collector.url, STEPSTREAM_LOG_FORMAT="json"
    )
    source = "from tests.workflows import arith  # noqa: F401\n"
    server = start_dev(tmp_path, "refused", source, env=env)
    try:
        async with Client.connect(server.url) as client:
            instance_id = await client.start("arith", 1)
            assert await client.result(instance_id, timeout=30) == {"total": 2, "doubled": 4}
        dropped: dict[str, float] = {}
        async with aiohttp.ClientSession() as http:
            for _ in range(100):  # the exporter sends within FLUSH_AFTER_S (0.2 s)
                async with http.get(f"{server.url}/metrics") as response:
                    text = await response.text()
                dropped = {
                    line.split('"')[1]: float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("stepstream_spans_dropped_total{")
                }
                if dropped.get("export_failed", 0) >= 3:
                    break
                await asyncio.sleep(0.1)
    finally:
        server.stop()
        collector.close()
    # The run and its two steps at least (the start's producer span may share a batch).
    assert dropped["export_failed"] >= 3, dropped
    # Logging as JSON, every line on stderr is one JSON object, the exporter process's
    # own included (it says why spans were lost).
    lines = server.log.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert any("could not export" in r["msg"] for r in records), lines
