"""`/metrics`, `/healthz` and `/readyz`: scraped from `stepstream dev` and from a Kafka
worker while they run, and checked against what ran."""

from __future__ import annotations

import asyncio
import json
import platform
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

import stepstream
from stepstream.engine.errors import UnknownInstance
from stepstream.producers.client import Client
from tests.conftest import ThreadedWorker, kafka_url
from tests.dev_server import start_dev
from tests.helm.metric_names import METRICS

WORKFLOWS = textwrap.dedent(
    """
    import asyncio
    from datetime import timedelta

    from stepstream import Context, NonRetryableError, RetryPolicy, workflow

    attempts: dict[str, int] = {}

    def charge(i: int) -> int:
        return i

    def flaky(key: str) -> str:
        attempts[key] = attempts.get(key, 0) + 1
        if attempts[key] == 1:
            raise RuntimeError("transient")
        return key

    def declined() -> None:
        raise NonRetryableError("card declined")

    @workflow("orders")
    async def orders(ctx: Context, key: str) -> str:
        for i in range(3):
            await ctx.step("charge", charge, i)  # one name, three keys: one label
        await ctx.sleep("settle", timedelta(milliseconds=50))
        return await ctx.step("flaky", flaky, key, retry=RetryPolicy(initial_interval=0.01))

    @workflow("declined")
    async def declined_wf(ctx: Context, _: None) -> None:
        await ctx.step("pay", declined)

    async def hang() -> None:
        await asyncio.sleep(60)

    @workflow("hanging")
    async def hanging(ctx: Context, _: None) -> None:
        policy = RetryPolicy(max_attempts=2, initial_interval=0.01)
        await ctx.step("call", hang, retry=policy, timeout=0.05)
    """
)


def _scrape(
    url: str, token: str | None = None
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    request = urllib.request.Request(f"{url}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert "instance" not in sample.labels and "instance_id" not in sample.labels
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def _families(url: str) -> dict[str, str]:
    """Every metric family served: its name as a query selects it, and its type."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        f"{family.name}_total" if family.type == "counter" else family.name: family.type
        for family in text_string_to_metric_families(text)
    }


def _value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _labels(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str
) -> list[dict[str, str]]:
    """The label sets of every sample called ``name``."""
    return [dict(labels) for (sample, labels), _ in samples.items() if sample == name]


def _assert_process_and_build(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], backend: str
) -> None:
    """The process's own collectors, and which build this is."""
    assert _labels(samples, "stepstream_build_info") == [
        {
            "version": stepstream.__version__,
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "backend": backend,
        }
    ]
    assert _value(samples, "process_resident_memory_bytes") > 1_000_000
    assert _value(samples, "process_cpu_seconds_total") > 0
    assert _value(samples, "process_open_fds") > 0
    assert {labels["generation"] for labels in _labels(samples, "python_gc_collections_total")} == {
        "0",
        "1",
        "2",
    }
    assert _labels(samples, "python_info")[0]["version"] == platform.python_version()


def _get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_dev_metrics_count_what_ran(tmp_path: Path) -> None:
    server = start_dev(tmp_path, "shop", WORKFLOWS)
    try:
        async with Client.connect(server.url) as client:
            ids = [await client.start("orders", f"o{n}", instance_id=f"o{n}") for n in range(4)]
            failing = await client.start("declined", None, instance_id="d1")
            hanging = await client.start("hanging", None, instance_id="h1")
            for instance_id in ids:
                assert await client.result(instance_id, timeout=30) == instance_id
            for instance_id, why in [(failing, "card declined"), (hanging, "StepTimeout")]:
                with pytest.raises(stepstream.WorkflowFailed, match=why):
                    await client.result(instance_id, timeout=30)
        # Plain HTTP requests, as curl or a browser makes them: one found, one not, one
        # path no route serves.
        before = _scrape(server.url)
        assert _get(f"{server.url}/v1/instances/o1")[0] == 200
        assert _get(f"{server.url}/v1/instances/nobody")[0] == 404
        assert _get(f"{server.url}/v2/nothing-here")[0] == 404
        # Counters are taken after the commit that made them true; the result above is
        # answered after that same commit.
        samples = _scrape(server.url)
        # The names the chart's alerts, the dashboard and docs/operations.md use.
        assert _families(server.url) == METRICS
    finally:
        server.stop()

    assert _value(samples, "stepstream_workflows_total", workflow="orders", outcome="started") == 4
    assert (
        _value(samples, "stepstream_workflows_total", workflow="orders", outcome="completed") == 4
    )
    assert _value(samples, "stepstream_workflows_total", workflow="declined", outcome="failed") == 1
    steps = "stepstream_steps_total"
    assert _value(samples, steps, workflow="orders", step="charge", outcome="succeeded") == 12
    assert _value(samples, steps, workflow="orders", step="flaky", outcome="retried") == 4
    assert _value(samples, steps, workflow="orders", step="flaky", outcome="succeeded") == 4
    assert _value(samples, steps, workflow="declined", step="pay", outcome="failed") == 1
    # A timeout that is retried, then one that gives up: the give-up is a failure, which
    # the StepstreamStepsFailing alert counts.
    assert _value(samples, steps, workflow="hanging", step="call", outcome="timed_out") == 1
    assert _value(samples, steps, workflow="hanging", step="call", outcome="failed") == 1
    durations = "stepstream_step_attempt_duration_seconds_count"
    assert _value(samples, durations, workflow="orders", step="charge") == 12
    assert _value(samples, durations, workflow="orders", step="flaky") == 8
    runs = "stepstream_workflow_duration_seconds_count"
    assert _value(samples, runs, workflow="orders", outcome="completed") == 4
    # Every order slept 50 ms and waited out a retry backoff, and the hanging call one
    # backoff: timers fired and were timed.
    applied = "stepstream_commands_applied_total"
    assert _value(samples, applied, type="StartWorkflow") == 6
    assert _value(samples, applied, type="TimerFired") == 9
    assert _value(samples, "stepstream_timer_lateness_seconds_count") == 9
    fired = "stepstream_timers_fired_total"  # by the processor's hand, or round the log
    assert _value(samples, fired, path="direct") + _value(samples, fired, path="log") == 9
    assert _value(samples, fired, path="direct") > 0
    assert _value(samples, "stepstream_commit_duration_seconds_count") > 0
    assert _value(samples, "stepstream_parked_instances") == 0
    assert _value(samples, "stepstream_partitions_owned") == 4
    assert _value(samples, "stepstream_ready") == 1
    assert _value(samples, "stepstream_rocksdb_memory_limit_bytes") == 64 << 20  # default
    assert sum(v for (name, _), v in samples.items() if name == "stepstream_timers_pending") == 0
    assert sum(v for (name, _), v in samples.items() if name == "stepstream_timers_held") == 0
    # Ownership, partition by partition.
    owned = {
        dict(labels)["partition"]: value
        for (name, labels), value in samples.items()
        if name == "stepstream_partition_owned"
    }
    assert owned == {"0": 1, "1": 1, "2": 1, "3": 1}
    # Schedule-to-start: every start the client sent, every attempt (first ones and
    # retries) the engine launched.
    start_delay = "stepstream_workflow_schedule_to_start_seconds_count"
    assert _value(samples, start_delay, workflow="orders") == 4
    assert _value(samples, start_delay, workflow="declined") == 1
    step_delay = "stepstream_step_schedule_to_start_seconds_count"
    assert _value(samples, step_delay, workflow="orders", step="charge") == 12
    assert _value(samples, step_delay, workflow="orders", step="flaky") == 8
    assert _value(samples, step_delay, workflow="declined", step="pay") == 1
    # A retry is due 10 ms after its failure; it starts after the timer fires and the
    # processor applies it: a delay, but not seconds of one.
    delay_sum = _value(
        samples, "stepstream_step_schedule_to_start_seconds_sum", workflow="orders", step="flaky"
    )
    assert 0 <= delay_sum < 8 * 1.0
    # HTTP requests, by route template (never the id in the path), method and status.
    requests = "stepstream_http_requests_total"
    by_id = "/v1/instances/{id}"

    def made(**labels: str) -> float:
        return _value(samples, requests, **labels) - _value(before, requests, **labels)

    assert made(route=by_id, method="GET", code="200") == 1
    assert made(route=by_id, method="GET", code="404") == 1
    assert made(route="unmatched", method="GET", code="404") == 1
    assert made(route="/metrics", method="GET", code="200") == 1  # the scrape of `before`
    assert _value(samples, requests, route="/v1/session", method="GET", code="101") >= 1
    routes = {labels["route"] for labels in _labels(samples, requests)}
    assert not [r for r in routes if "o1" in r or "nobody" in r or "nothing-here" in r]
    durations = "stepstream_http_request_duration_seconds_count"
    assert _value(samples, durations, route=by_id, method="GET") == 2
    assert _value(samples, durations, route="unmatched", method="GET") >= 1
    _assert_process_and_build(samples, "embedded")


async def test_dev_rocksdb_memory_is_the_budget_set(tmp_path: Path) -> None:
    """STEPSTREAM_ROCKSDB_MEMORY_MB sets what the engine's RocksDB may hold (blocks and
    write buffers together), and /metrics shows it against the budget; a budget that is
    not a number stops the engine with a message naming the variable."""
    from tests.dev_server import clean_env, run_cli

    server = start_dev(
        tmp_path, "shop", WORKFLOWS, env=clean_env(tmp_path, STEPSTREAM_ROCKSDB_MEMORY_MB="24")
    )
    try:
        async with Client.connect(server.url) as client:
            ids = [await client.start("orders", f"o{n}", instance_id=f"o{n}") for n in range(3)]
            for instance_id in ids:
                assert await client.result(instance_id, timeout=30) == instance_id
        samples = _scrape(server.url)
    finally:
        server.stop()
    assert _value(samples, "stepstream_rocksdb_memory_limit_bytes") == 24 << 20
    assert 0 < _value(samples, "stepstream_rocksdb_memory_bytes") <= 24 << 20

    refused = run_cli(
        tmp_path,
        "dev",
        "--workflows",
        "shop",
        "--data",
        str(tmp_path / "other"),
        "--port",
        "0",
        env=clean_env(tmp_path, STEPSTREAM_ROCKSDB_MEMORY_MB="lots"),
    )
    assert refused.returncode != 0
    assert "STEPSTREAM_ROCKSDB_MEMORY_MB='lots' is not a whole number" in refused.stderr


def test_dev_and_worker_help_say_where_the_metrics_are(tmp_path: Path) -> None:
    from tests.dev_server import run_cli

    for command in ("dev", "worker"):
        shown = run_cli(tmp_path, command, "--help")
        assert shown.returncode == 0, shown.stderr
        text = " ".join(shown.stdout.split())
        assert "Prometheus metrics at /metrics" in text, text
        assert "process_* and python_*" in text and "docs/operations.md" in text
        assert "$STEPSTREAM_ROCKSDB_MEMORY_MB (default 64)" in text


def test_probes_answer_without_a_token_and_metrics_need_it(tmp_path: Path) -> None:
    from tests.dev_server import clean_env

    server = start_dev(
        tmp_path, "shop", WORKFLOWS, env=clean_env(tmp_path, STEPSTREAM_API_TOKEN="s3cret")
    )
    try:
        assert _get(f"{server.url}/healthz")[0] == 200
        status, body = _get(f"{server.url}/readyz")
        assert (status, body) == (200, {"ready": True})
        try:
            urllib.request.urlopen(f"{server.url}/metrics", timeout=10)
            raise AssertionError("/metrics answered without the token")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        assert _value(_scrape(server.url, token="s3cret"), "stepstream_ready") == 1
    finally:
        server.stop()


async def test_kafka_worker_metrics_and_readiness(kafka_worker: ThreadedWorker) -> None:
    worker = kafka_worker.worker
    async with Client.connect(kafka_url(kafka_worker.settings)) as client:
        ids = [await client.start("arith", n) for n in range(3)]
        for instance_id in ids:
            await client.result(instance_id, timeout=30)
    # Every reason is on /metrics before its first dead letter, at 0: an alert on the
    # counter's increase must see the first one (a series born at 1 shows no increase).
    before = _scrape(worker.url)
    for reason in ("undecodable", "unknown_instance", "other"):
        key = ("stepstream_dead_letters_total", frozenset({("reason", reason)}))
        assert before.get(key) == 0, (reason, sorted(k for k in before if "dead" in k[0]))
    # An event for an instance that was never started: dead-lettered as unknown_instance.
    async with Client.connect(kafka_url(kafka_worker.settings)) as client:
        with pytest.raises(UnknownInstance):
            await client.send_event("never-started", "go", {})
    # A record no reader can decode, produced by a foreign tool: dead-lettered, counted.
    producer = Producer({"bootstrap.servers": kafka_worker.settings.bootstrap})
    producer.produce(f"{kafka_worker.settings.prefix}.commands", b"not avro", key=b"x", partition=0)
    producer.flush(10)
    for _ in range(200):
        samples = _scrape(worker.url)
        if _value(samples, "stepstream_dead_letters_total", reason="undecodable") >= 1:
            break
        await asyncio.sleep(0.05)
    assert _value(samples, "stepstream_dead_letters_total", reason="undecodable") == 1
    assert _value(samples, "stepstream_dead_letters_total", reason="unknown_instance") == 1
    assert _value(samples, "stepstream_dead_letters_total", reason="other") == 0
    assert _value(samples, "stepstream_workflows_total", workflow="arith", outcome="completed") == 3
    steps = "stepstream_steps_total"
    assert _value(samples, steps, workflow="arith", step="add", outcome="succeeded") == 3
    assert _value(samples, steps, workflow="arith", step="double", outcome="succeeded") == 3
    assert _value(samples, "stepstream_partitions_owned") == 2
    assert _value(samples, "stepstream_partition_owned", partition="0") == 1
    assert _value(samples, "stepstream_partition_owned", partition="1") == 1
    start_delay = "stepstream_workflow_schedule_to_start_seconds_count"
    assert _value(samples, start_delay, workflow="arith") == 3
    step_delay = "stepstream_step_schedule_to_start_seconds_count"
    assert _value(samples, step_delay, workflow="arith", step="add") == 3
    # The scrapes above were requests too.
    scrapes = "stepstream_http_requests_total"
    assert _value(samples, scrapes, route="/metrics", method="GET", code="200") >= 1
    _assert_process_and_build(samples, "kafka")
    assert _value(samples, "stepstream_rebalances_total") >= 1
    assert _value(samples, "stepstream_restore_duration_seconds", partition="0") > 0
    assert _value(samples, "stepstream_ready") == 1
    assert _get(f"{worker.url}/readyz")[0] == 200
    # Consumer lag: the log end the consumer heard of, less what was applied; all of it.
    group = worker._runner._group

    def heard() -> int:  # commands the consumer knows the partitions hold
        return sum(group.high_watermark("commands", p) or 0 for p in (0, 1))

    for _ in range(100):
        if heard() >= 4:  # three starts and the undecodable record
            break
        await asyncio.sleep(0.05)
    assert heard() >= 4
    for partition in (0, 1):
        assert group.high_watermark("commands", partition) is not None
        lag = _value(
            _scrape(worker.url), "stepstream_consumer_lag_records", partition=str(partition)
        )
        assert lag == 0

    # The group takes the partitions away without a hand-over (the session expired):
    # the worker is not ready until it is assigned partitions again.
    await kafka_worker.call(worker._runner._lose([0, 1]))
    status, body = _get(f"{worker.url}/readyz")
    assert status == 503 and body["ready"] is False
    assert "restoring" in str(body["reason"])
    after_loss = _scrape(worker.url)
    assert _value(after_loss, "stepstream_ready") == 0
    # The partitions' restore durations went with them (their next owner reports its own),
    # and so did their ownership.
    assert not [k for k in after_loss if k[0] == "stepstream_restore_duration_seconds"]
    assert not _labels(after_loss, "stepstream_partition_owned")
