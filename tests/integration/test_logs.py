"""Log lines an operator can use: with `--log-format json`, one JSON object per line whose
context (instance, workflow, step, attempt, partition, trace and span ids) are fields,
failures at WARNING (will retry) or ERROR (for good, workflow failed) with the
traceback, and the trace id the exported spans have, on `stepstream dev` and on a Kafka
worker. A client speaking broken HTTP cannot flood the log."""

from __future__ import annotations

import json
import socket
import subprocess
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from stepstream import WorkflowFailed
from stepstream.consumers.kafka import create_topics
from stepstream.producers.client import Client
from tests.conftest import KAFKA_TEST_PARTITIONS, kafka_settings, kafka_url
from tests.dev_server import REPO, clean_env, free_port, run_cli, start_dev
from tests.kafka_broker import Broker
from tests.otlp_collector import OtlpCollector
from tests.processes import launch, worker_command

WORKFLOWS = textwrap.dedent(
    """
    import logging

    from stepstream import Context, RetryPolicy, workflow

    alerts = []

    def charge_card() -> str:
        logging.getLogger("shop").info("charging the card")
        raise RuntimeError("card declined")

    def page_on_call(event) -> None:  # sync: runs on the hook runner's threads
        alerts.append(event)
        if len(alerts) == 1:
            raise ConnectionError("pager unreachable")
        logging.getLogger("shop").info("paged on-call step=%s", event.step)

    async def audit(event) -> None:  # async: runs on the loop
        logging.getLogger("shop").info("audit %s", event.new_status)

    @workflow("charge", on_error=page_on_call, on_status_change=audit)
    async def charge(ctx: Context, _: None) -> str:
        return await ctx.step(
            "card", charge_card, retry=RetryPolicy(max_attempts=2, initial_interval=0.01)
        )
    """
)


def _lines(log: Path) -> list[dict[str, Any]]:
    # librdkafka writes its own lines (``%4|...``) to stderr, outside Python's logging.
    lines = log.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip() and not line.startswith("%")]


def _run_span(collector: OtlpCollector) -> tuple[str, str]:
    """The run span: the first activation, which the run's later ones hang off."""
    process = [span for span in collector.spans if span.name.startswith("process ")]
    activations = {span.span_id for span in process}
    (run,) = [span for span in process if span.parent_span_id not in activations]
    return run.trace_id.hex(), run.span_id.hex()


def _check_failure_lines(lines: list[dict[str, Any]], instance_id: str, ids: tuple[str, str]):
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines), lines
    mine = [line for line in lines if line.get("instance_id") == instance_id]
    context = {"instance_id": instance_id, "workflow": "charge", "trace_id": ids[0]}
    context["span_id"] = ids[1]

    def one(prefix: str) -> dict[str, Any]:
        found = [line for line in mine if line["msg"].startswith(prefix)]
        assert len(found) == 1, (prefix, mine)
        assert {k: found[0].get(k) for k in context} == context, found[0]
        assert isinstance(found[0]["partition"], int), found[0]
        return found[0]

    retry = one("step attempt failed, will retry")
    assert (retry["level"], retry["step"], retry["attempt"]) == ("WARNING", "card", 1)
    assert "Traceback" in retry["exception"] and "in charge_card" in retry["exception"]
    assert "RuntimeError: card declined" in retry["exception"]
    final = one("step failed for good")
    assert (final["level"], final["step"], final["attempt"]) == ("ERROR", "card", 2)
    assert "RuntimeError: card declined" in final["exception"]
    failed = one("workflow failed")
    assert failed["level"] == "ERROR" and "step" not in failed
    assert "Traceback" in failed["exception"] and "StepFailed" in failed["exception"]
    # The step body's own logging carries the attempt it runs in.
    attempts = [line for line in mine if line["msg"] == "charging the card"]
    assert [(line["step"], line["attempt"]) for line in attempts] == [("card", 1), ("card", 2)]
    assert all(line["trace_id"] == ids[0] for line in attempts)
    # Hooks: the runner's lines about a call and the hook's own lines (a sync hook on a
    # thread, an async one on the loop) carry the instance, its run's trace and the hook.
    hooked = {
        "hook failed, retrying": "on_error",
        "paged on-call step=card": "on_error",
        "audit failed": "on_status_change",
    }
    for msg, hook in hooked.items():
        found = [line for line in mine if line["msg"].startswith(msg)]
        assert found, (msg, mine)
        for line in found:
            assert {k: line.get(k) for k in context} == context, line
            assert line["hook"] == hook and isinstance(line["partition"], int), line
    assert "ConnectionError: pager unreachable" in one("hook failed, retrying")["msg"]


def _until_hooks_ran(log: Path, timeout: float = 30) -> None:
    """Hooks run after the failure is durable (a client's result can come first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "audit failed" in log.read_text() and "paged on-call" in log.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"the hooks did not run within {timeout} s\n{log.read_text()}")


async def test_dev_logs_failures_as_fields_in_the_trace_it_exports(tmp_path: Path) -> None:
    collector = OtlpCollector()
    env = clean_env(
        tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=collector.url, OTEL_BSP_SCHEDULE_DELAY="100"
    )
    server = start_dev(tmp_path, "shop_flows", WORKFLOWS, "--log-format", "json", env=env)
    tracer = TracerProvider().get_tracer("test")
    try:
        async with Client.connect(server.url) as client:
            with tracer.start_as_current_span("checkout") as checkout:
                instance_id = await client.start("charge", None, instance_id="c-1")
            with pytest.raises(WorkflowFailed):
                await client.result(instance_id, timeout=30)
        _until_hooks_ran(server.log)
    finally:
        server.stop()  # the exporter process flushes on the way out
        collector.close()
    ids = _run_span(collector)
    assert ids[0] == format(checkout.get_span_context().trace_id, "032x")  # the caller's
    lines = _lines(server.log)
    _check_failure_lines(lines, instance_id, ids)
    # A new data directory: opened, with its context in fields; nothing to re-index, so no
    # word of an older version or a rollback.
    [opened] = [line for line in lines if line["msg"] == "embedded data directory opened"]
    assert opened["partitions"] == 4 and opened["durability"] and opened["path"], opened
    assert not [line for line in lines if "rollback" in line["msg"]], lines


@pytest.mark.slow
async def test_a_kafka_worker_logs_the_trace_of_a_run_started_without_one(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    (tmp_path / "shop_flows.py").write_text(WORKFLOWS)
    settings = kafka_settings(kafka_broker, f"t{uuid.uuid4().hex[:10]}")
    create_topics(settings, KAFKA_TEST_PARTITIONS)
    collector = OtlpCollector()
    env = clean_env(
        tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=collector.url, OTEL_BSP_SCHEDULE_DELAY="100"
    )
    env["PYTHONPATH"] = f"{tmp_path}:{REPO}"
    command = worker_command(
        "shop_flows", settings.bootstrap, settings.prefix, tmp_path / "state", []
    )
    log = tmp_path / "worker.log"
    proc, _ = launch([*command, "--log-format", "json"], env=env, log=log)
    try:
        async with Client.connect(kafka_url(settings)) as client:
            instance_id = await client.start("charge", None, instance_id="k-1")  # no span
            with pytest.raises(WorkflowFailed):
                await client.result(instance_id, timeout=60)
        _until_hooks_ran(log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        collector.close()
    _check_failure_lines(_lines(log), instance_id, _run_span(collector))


def _send_broken_http(url: str) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    for _ in range(50):
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
            assert b" 400 Bad Request" in conn.recv(4096).split(b"\r\n")[0]


def _check_broken_http_logged_once(log: Path) -> None:
    text = log.read_text()
    lines = _lines(log)
    malformed = [line for line in lines if "malformed HTTP" in line["msg"]]
    assert len(malformed) == 1, text
    assert malformed[0]["level"] == "WARNING" and "exception" not in malformed[0]
    assert malformed[0]["peer"] == "127.0.0.1"
    assert "Traceback" not in text and not [x for x in lines if x["level"] == "ERROR"], text


def test_broken_http_from_one_peer_is_logged_once_without_traceback(tmp_path: Path) -> None:
    source = "from tests.workflows import arith  # noqa: F401\n"
    server = start_dev(tmp_path, "plain", source, "--log-format", "json")
    try:
        _send_broken_http(server.url)
        with urllib.request.urlopen(f"{server.url}/healthz", timeout=10) as answer:
            assert answer.status == 200
    finally:
        server.stop()
    _check_broken_http_logged_once(server.log)
    # dev's access log: one line a request, its context in fields like every other line.
    access = [x for x in _lines(server.log) if x["logger"] == "aiohttp.access"][-1]
    assert access["msg"] == "GET /healthz 200", access
    assert (access["method"], access["path"], access["status"]) == ("GET", "/healthz", 200)
    assert access["peer"] == "127.0.0.1" and access["bytes"] > 0 and access["seconds"] >= 0


def test_broken_http_to_a_kafka_worker_is_logged_once_too(
    kafka_broker: Broker, tmp_path: Path
) -> None:
    (tmp_path / "plain.py").write_text("from tests.workflows import arith  # noqa: F401\n")
    settings = kafka_settings(kafka_broker, f"t{uuid.uuid4().hex[:10]}")
    create_topics(settings, KAFKA_TEST_PARTITIONS)
    env = clean_env(tmp_path)
    command = worker_command("plain", settings.bootstrap, settings.prefix, tmp_path / "state", [])
    log = tmp_path / "worker.log"
    proc, url = launch([*command, "--log-format", "json"], env=env, log=log)
    try:
        _send_broken_http(url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    _check_broken_http_logged_once(log)


def test_a_bad_log_format_is_refused(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "list", "--log-format", "xml")
    assert result.returncode == 2
    assert "invalid choice: 'xml'" in result.stderr
    # Any case, as $STEPSTREAM_LOG_FORMAT and --log-level take it.
    assert run_cli(tmp_path, "list", "--log-format", "JSON", "--help").returncode == 0


CANCELLABLE = textwrap.dedent(
    """
    import time

    from stepstream import Context, attempt_cancelled, workflow

    def long_call() -> str:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not attempt_cancelled():
            time.sleep(0.01)
        return "done"

    @workflow("long")
    async def long(ctx: Context, _: None) -> str:
        return await ctx.step("long-call", long_call)
    """
)


def test_a_cancel_logs_the_step_attempt_it_gave_up_and_counts_it(tmp_path: Path) -> None:
    server = start_dev(tmp_path, "long_flows", CANCELLABLE, "--log-format", "json")
    try:
        assert server.cli("start", "long", "--id", "cx-1").returncode == 0
        deadline = time.monotonic() + 20
        while "StepAttemptStarted" not in server.cli("history", "cx-1", "--json").stdout:
            assert time.monotonic() < deadline, "the step never started"
            time.sleep(0.05)
        cancelled = server.cli("cancel", "cx-1", "--reason", "customer called")
        assert cancelled.returncode == 0, cancelled.stderr
        deadline = time.monotonic() + 20
        while not [x for x in _lines(server.log) if x["msg"].startswith("workflow cancelled")]:
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.05)
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
    finally:
        server.stop()
    [line] = [x for x in _lines(server.log) if x["msg"].startswith("workflow cancelled")]
    assert line["msg"] == "workflow cancelled: customer called; gave up long-call (attempt 1)"
    assert line["level"] == "INFO" and line["instance_id"] == "cx-1", line
    assert line["workflow"] == "long", line
    counted = 'stepstream_steps_total{outcome="cancelled",step="long-call",workflow="long"} 1.0'
    assert counted in metrics, metrics


PUBLISHING = textwrap.dedent(
    """
    from stepstream import Context, workflow

    @workflow("announce")
    async def announce(ctx: Context, order: str) -> None:
        await ctx.publish("shop.orders", {"order": order})
    """
)


def _announce(
    tmp_path: Path, env: dict[str, str], *flags: str
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """``stepstream run`` of PUBLISHING's workflow, logging JSON: the run and its lines."""
    (tmp_path / "announcing.py").write_text(PUBLISHING)
    command = ["run", "announcing:announce", "--input", '"o-1"', *flags, "--log-format", "json"]
    done = run_cli(tmp_path, *command, env=env)
    return done, [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]


def test_an_engine_refusal_is_logged_without_a_traceback_of_the_engine(tmp_path: Path) -> None:
    """``ctx.publish`` on an engine with no outbox fails the step at once. Its traceback
    lies wholly in stepstream's own code, so the step's ERROR line carries the message
    alone; the workflow's line keeps the traceback that points at the user's await."""
    env = clean_env(tmp_path)
    env.pop("STEPSTREAM_OUTBOX_BOOTSTRAP", None)
    done, lines = _announce(tmp_path, env)
    assert done.returncode == 1, done.stderr
    (step,) = [line for line in lines if line["msg"].startswith("step failed for good")]
    assert "STEPSTREAM_OUTBOX_BOOTSTRAP" in step["msg"] and "exception" not in step, step
    (failed,) = [line for line in lines if line["msg"].startswith("workflow failed")]
    assert 'announcing.py", line 6, in announce' in failed["exception"], failed


def test_the_outboxs_kafka_client_logs_in_the_processs_format(tmp_path: Path) -> None:
    """An engine whose outbox cannot reach its cluster: librdkafka's own lines about it
    come through logging, JSON like every other line, not raw on stderr."""
    env = clean_env(
        tmp_path,
        STEPSTREAM_OUTBOX_BOOTSTRAP=f"127.0.0.1:{free_port()}",  # nothing listens
        STEPSTREAM_DRAIN_TIMEOUT_S="0.5",
    )
    done, logged = _announce(tmp_path, env, "--timeout", "2")
    assert done.returncode == 3, done.stderr  # gave up waiting: the publish goes on trying
    assert not [line for line in done.stderr.splitlines() if line.startswith("%")], done.stderr
    librdkafka = [line for line in logged if line["logger"] == "stepstream.kafka.librdkafka"]
    assert any("Connection refused" in line["msg"] for line in librdkafka), logged
