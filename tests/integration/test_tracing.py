"""OpenTelemetry: every command a client publishes gets a producer span carrying its W3C
trace context; each activation of a run (the instance driven after an input) and each
step attempt gets a span in the run's trace, after the messaging and exception semantic
conventions; on both backends, across a restart, and for children and events."""

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
from opentelemetry.trace import SpanKind, StatusCode

import stepstream
from stepstream.consumers.kafka import create_topics
from stepstream.engine.wire.run_trace import run_span_id
from stepstream.ops.embedded import EmbeddedConfig, open_embedded
from stepstream.ops.telemetry import tracing
from stepstream.producers.client import Client
from tests.conftest import KAFKA_TEST_PARTITIONS, ThreadedWorker, kafka_settings, kafka_url
from tests.conftest import test_registry as registry
from tests.kafka_broker import Broker
from tests.otlp_collector import OtlpCollector as _Collector


@pytest.fixture(scope="module")
def provider() -> Iterator[TracerProvider]:
    provider = TracerProvider()
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


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def _parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _activations(
    spans: dict[str, list[ReadableSpan]], name: str, instance_id: str
) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The run span (the first activation) of ``instance_id`` and its later activations,
    each checked to be under the run span."""
    mine = [s for s in spans.get(name, []) if _attrs(s)["stepstream.instance_id"] == instance_id]
    firsts = [s for s in mine if "StartWorkflow" in _attrs(s)["stepstream.inputs"].split(",")]
    assert len(firsts) == 1, [(s.name, _attrs(s)) for s in mine]
    (run,) = firsts
    assert run.kind is SpanKind.CONSUMER
    later = sorted((s for s in mine if s is not run), key=lambda s: s.start_time or 0)
    for activation in later:
        assert _parent_id(activation) == _span_id(run), _attrs(activation)
    return run, later


def _check_scopes(spans: dict[str, list[ReadableSpan]]) -> None:
    for group in spans.values():
        for span in group:
            scope = span.instrumentation_scope
            if scope is not None and scope.name.startswith("stepstream."):
                assert scope.version == stepstream.__version__, span.name


def _check_one_trace(
    spans: dict[str, list[ReadableSpan]],
    checkout: ReadableSpan,
    instance_id: str,
    *,
    send_name: str,
    process_name: str,
) -> tuple[ReadableSpan, ReadableSpan, list[ReadableSpan]]:
    """checkout (the caller) -> send (client, producer) -> the run span (the worker's
    first activation) -> later activations and steps add, double. Returns (send, run,
    later activations)."""
    (send,) = spans[send_name]
    assert send.kind is SpanKind.PRODUCER
    assert _parent_id(send) == _span_id(checkout)
    assert _attrs(send)["stepstream.instance_id"] == instance_id
    assert _attrs(send)["stepstream.command"] == "StartWorkflow"
    run, later = _activations(spans, process_name, instance_id)
    assert _parent_id(run) == _span_id(send)
    assert run.start_time is not None and run.start_time >= (send.start_time or 0)
    # One span per activation: the start, each step's outcome; the last one completed it.
    assert [_attrs(a)["stepstream.inputs"] for a in later] == ["StepOutcome", "StepOutcome"]
    assert _attrs(run)["stepstream.status"] == "running"
    assert _attrs(later[-1])["stepstream.status"] == "completed"
    for name in ("add", "double"):
        (step,) = spans[f"step {name}"]
        assert _parent_id(step) == _span_id(run)
        attributes = _attrs(step)
        assert attributes["stepstream.workflow"] == "arith"
        assert attributes["stepstream.step"] == name
        assert attributes["stepstream.attempt"] == 1
        assert attributes["stepstream.instance_id"] == instance_id
        assert attributes["stepstream.outcome"] == "succeeded"
        assert step.start_time is not None  # a record's time: in ms
        assert run.start_time // 1_000_000 <= step.start_time // 1_000_000
    _check_scopes(spans)
    return send, run, later


async def test_embedded_spans_one_per_activation_in_the_callers_trace(
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
    _, run, _ = _check_one_trace(
        spans, caller, instance_id, send_name="send StartWorkflow", process_name="process arith"
    )
    # The run span's id is derived from the instance: what a child's start names.
    assert _span_id(run) == run_span_id(instance_id, _attrs_ms(run))
    # No messaging system carries the embedded engine's commands: no messaging.* at all.
    for group in spans.values():
        for span in group:
            assert not [k for k in _attrs(span) if k.startswith("messaging.")], span.name


def _attrs_ms(run: ReadableSpan) -> int:
    """The run's start in ms, as the engine recorded it (the run span begins then or a
    moment after): found by trying the few ms before the span's start."""
    assert run.start_time is not None and run.context is not None
    start_ms = run.start_time // 1_000_000
    instance_id = _attrs(run)["stepstream.instance_id"]
    for ms in range(start_ms, start_ms - 5000, -1):
        if run_span_id(instance_id, ms) == run.context.span_id:
            return ms
    raise AssertionError("the run span's id is not derived from its instance and start")


async def test_failures_record_exception_events_and_children_join_the_parents_trace(
    tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    engine = await open_embedded(
        registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    )
    tracing.install(engine.host, provider)
    app = provider.get_tracer("shop")
    async with Client(engine.make_transport(owns_engine=True)) as client:
        with app.start_as_current_span("order") as order:
            instance_id = await client.start("parent", {"n": 1})
        outcome = await client.result(instance_id, timeout=30)
    assert outcome[2:] == ["failed", "StepFailed"], outcome
    spans = _trace(exporter, order.get_span_context().trace_id)
    parent_run, _ = _activations(spans, "process parent", instance_id)
    kids = {_attrs(s)["stepstream.instance_id"] for s in spans["process kid"]}
    assert len(kids) == 3 and f"{instance_id}-bad" in kids, kids
    _, parent_later = _activations(spans, "process parent", instance_id)
    linked = {link.context.span_id for a in parent_later for link in a.links}
    for kid in kids:
        kid_run, _ = _activations(spans, "process kid", kid)
        # A child's run is a span of its parent's run, in its parent's trace; the
        # parent's activation that learnt how the child ended links to the child's run.
        assert _parent_id(kid_run) == _span_id(parent_run), kid
        assert _span_id(kid_run) in linked, kid
    # The failed attempt: ERROR, and an exception event with type, message, stacktrace.
    (attempt,) = spans["step break"]
    assert attempt.status.status_code is StatusCode.ERROR
    (event,) = attempt.events
    assert event.name == "exception"
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "NonRetryableError"
    assert event.attributes["exception.message"] == "card declined"
    stack = str(event.attributes["exception.stacktrace"])
    assert stack.startswith("Traceback") and "in fatal" in stack and "card declined" in stack
    # The failed run: its last activation, with the workflow's own traceback.
    _, later = _activations(spans, "process kid", f"{instance_id}-bad")
    failed = later[-1]
    assert _attrs(failed)["stepstream.status"] == "failed"
    assert failed.status.status_code is StatusCode.ERROR
    (event,) = failed.events
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "StepFailed"
    assert "card declined" in str(event.attributes["exception.message"])
    assert "in kid" in str(event.attributes["exception.stacktrace"])
    # A run that succeeded has no exception event anywhere.
    assert not [e for s in spans["process parent"] for e in s.events]


async def test_only_the_activation_that_failed_the_run_is_an_error(
    tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """The outcome of a step the failure left running comes later, in an activation of
    its own: the run had failed already, that activation did not fail it."""
    engine = await open_embedded(registry(), EmbeddedConfig(data_dir=str(tmp_path / "d")))
    tracing.install(engine.host, provider)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        instance_id = await client.start("fail-beside-slow", 0.3)
        with pytest.raises(stepstream.WorkflowFailed):
            await client.result(instance_id, timeout=30)
        for _ in range(200):  # until the slow step's outcome came and was recorded
            mine = [
                s
                for s in exporter.get_finished_spans()
                if s.name == "process fail-beside-slow"
                and "StepOutcome" in str(_attrs(s).get("stepstream.inputs"))
            ]
            if len(mine) >= 2:
                break
            await asyncio.sleep(0.05)
    activations = [
        s
        for s in exporter.get_finished_spans()
        if s.name == "process fail-beside-slow"
        and _attrs(s)["stepstream.instance_id"] == instance_id
    ]
    assert len(activations) >= 3, [_attrs(s)["stepstream.inputs"] for s in activations]
    errors = [s for s in activations if s.status.status_code is StatusCode.ERROR]
    assert len(errors) == 1, [(_attrs(s)["stepstream.inputs"], s.status) for s in activations]
    assert [e.name for e in errors[0].events] == ["exception"]
    # Every attempt has its span: the slow one, given up when the run failed, too.
    ended = [s for s in exporter.get_finished_spans() if s.name.startswith("step ")]
    assert sorted(s.name for s in ended) == ["step charge", "step slow"]
    steps = {s.name: s for s in ended}
    assert _attrs(steps["step slow"])["stepstream.outcome"] == "cancelled", steps
    assert steps["step slow"].status.status_code is not StatusCode.ERROR
    assert steps["step charge"].status.status_code is StatusCode.ERROR


async def test_every_command_has_a_span_and_an_event_links_to_its_send(
    tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    engine = await open_embedded(
        registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    )
    tracing.install(engine.host, provider)
    app = provider.get_tracer("ops")
    async with Client(engine.make_transport(owns_engine=True)) as client:
        with app.start_as_current_span("checkout") as checkout:
            instance_id = await client.start("gated", "g")
        while (await client.status(instance_id)).waits == []:
            await asyncio.sleep(0.02)
        with app.start_as_current_span("pause-it") as pausing:
            await client.pause(instance_id)
        with app.start_as_current_span("approve") as approving:
            await client.send_event(instance_id, "go", {"by": "ada"})
        with app.start_as_current_span("resume-it") as resuming:
            await client.resume(instance_id)
        await client.result(instance_id, timeout=30)
        with app.start_as_current_span("cancel-it") as cancelling:
            waiting = await client.start("waiter", None)
            await client.cancel(waiting, reason="no longer needed")
        with pytest.raises(stepstream.WorkflowCancelled):
            await client.result(waiting, timeout=30)
    sends = {}
    for caller, command in (
        (pausing, "PauseWorkflow"),
        (approving, "SendEvent"),
        (resuming, "ResumeWorkflow"),
    ):
        (send,) = _trace(exporter, caller.get_span_context().trace_id)[f"send {command}"]
        assert _parent_id(send) == caller.get_span_context().span_id
        sends[command] = send
    spans = _trace(exporter, checkout.get_span_context().trace_id)
    run, later = _activations(spans, "process gated", instance_id)
    by_input = {_attrs(a)["stepstream.inputs"].split(",")[0]: a for a in later}
    for command, send in sends.items():
        # Processed in the run's trace, linked to the send, whose trace is another.
        activation = by_input[command]
        assert [link.context.span_id for link in activation.links] == [_span_id(send)]
        assert activation.links[0].context.trace_id == send.context.trace_id  # type: ignore[union-attr]
    assert _attrs(by_input["PauseWorkflow"])["stepstream.status"] == "paused"
    # One span per activation: the run span ended long before the event came.
    assert (run.end_time or 0) < (sends["SendEvent"].start_time or 0)
    cancelled = _trace(exporter, cancelling.get_span_context().trace_id)
    (cancel_send,) = cancelled["send CancelWorkflow"]
    _, later = _activations(cancelled, "process waiter", waiting)
    assert _attrs(later[-1])["stepstream.inputs"] == "CancelWorkflow"
    assert _attrs(later[-1])["stepstream.status"] == "cancelled"
    assert _parent_id(cancel_send) == cancelling.get_span_context().span_id


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
    _, later = _activations(spans, "process waiter", instance_id)
    assert _attrs(later[-1])["stepstream.status"] == "completed"
    assert _attrs(later[-1])["stepstream.inputs"] == "SendEvent"


async def test_kafka_spans_name_the_topic_group_partition_and_offset(
    kafka_broker: Broker,
    tmp_path: Path,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    from stepstream.engine.wire.topics import partition_for

    prefix = f"shop{uuid.uuid4().hex[:8]}"
    settings = kafka_settings(kafka_broker, prefix)
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
    topic = f"{prefix}.commands"
    partition = str(partition_for(instance_id, KAFKA_TEST_PARTITIONS))
    spans = _trace(exporter, checkout.get_span_context().trace_id)
    (caller,) = spans["checkout"]
    send, run, later = _check_one_trace(
        spans, caller, instance_id, send_name=f"send {topic}", process_name=f"process {topic}"
    )
    # The start on the commands topic carries the trace in its headers, as any
    # tracing-aware Kafka tool expects, and in its Avro envelope.
    headers, envelope, offset, command_id = _start_record(settings, instance_id)
    trace_hex = format(checkout.get_span_context().trace_id, "032x")
    assert headers["traceparent"].decode() == envelope
    assert envelope.split("-")[1] == trace_hex
    assert _attrs(send) == {
        "messaging.system": "kafka",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": topic,
        "messaging.destination.partition.id": partition,
        "messaging.kafka.message.key": instance_id,
        "messaging.message.id": command_id,
        "stepstream.command": "StartWorkflow",
        "stepstream.instance_id": instance_id,
    }
    consumer = {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": topic,
        "messaging.consumer.group.name": f"{prefix}.workers",
        "messaging.destination.partition.id": partition,
    }
    assert _attrs(run) == {
        **consumer,
        "messaging.message.id": command_id,
        "messaging.kafka.offset": offset,
        "messaging.kafka.message.key": instance_id,
        "stepstream.workflow": "arith",
        "stepstream.version": "1",
        "stepstream.instance_id": instance_id,
        "stepstream.partition": int(partition),
        "stepstream.inputs": "StartWorkflow",
        "stepstream.status": "running",
    }
    # A step's outcome is no Kafka record: no offset, the rest as for any activation.
    for activation in later:
        attributes = _attrs(activation)
        assert {k: attributes[k] for k in consumer} == consumer
        assert "messaging.kafka.offset" not in attributes
    # The operator's guide lists every attribute the spans carry.
    guide = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    traces = guide[guide.index("### Traces") : guide.index("What tracing costs")]
    keys = {key for group in spans.values() for span in group for key in _attrs(span)}
    assert keys and not [key for key in keys if f"`{key}`" not in traces]


def _start_record(settings: Any, instance_id: str) -> tuple[dict[str, bytes], str, int, str]:
    """The StartWorkflow of ``instance_id`` on the commands topic: its headers, its
    envelope's traceparent, its offset and its command id."""
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
                offset = msg.offset()
                assert offset is not None
                return dict(msg.headers() or []), record.traceparent, offset, record.command_id
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
    names = sorted({span.name for span in collector.spans if span.trace_id == trace_id})
    # Through the HTTP API no messaging system carries the start: ``send <command>``.
    assert names == ["process arith", "send StartWorkflow", "step add", "step double"]
    activations = [s for s in collector.spans if s.name == "process arith"]
    run = next(s for s in activations if s.parent_span_id and s.kind == s.SPAN_KIND_CONSUMER)
    send = next(s for s in collector.spans if s.name == "send StartWorkflow")
    assert run.parent_span_id == send.span_id
    assert len(activations) == 3  # the start, and the outcome of each step
    for span in collector.spans:
        if span.name.startswith("step ") or (span.name == "process arith" and span is not run):
            assert span.parent_span_id == run.span_id, span.name
    assert {(s.name, s.version) for s in collector.scopes} == {
        ("stepstream.worker", stepstream.__version__),
        ("stepstream.client", stepstream.__version__),
    }


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
    # Said once, then at most every 10 s (each batch fails alike); the exporter's own
    # client does not repeat it for each batch and retry.
    warned = [r for r in records if "could not export" in r["msg"]]
    assert len(warned) <= 2, warned
    assert not [r for r in records if r["logger"].startswith("opentelemetry")], lines
