"""The engine's ``/metrics`` text, written by ``exposition.py`` with kept line starts, is
what prometheus_client writes for the same families, byte for byte: on a first scrape,
on a later one whose counts moved (the kept starts reused), and for a running engine."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from stepstream import WorkflowFailed
from stepstream.consumers.telemetry import BATCH_BUCKETS, LATENCY_BUCKETS_S, Histogram
from stepstream.ops.telemetry.exposition import Family, SeriesText


class _Families:
    def __init__(self, families: list[Family]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family.metric()


def _by_prometheus_client(families: list[Family]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry).decode()


def _families(scale: int) -> list[Family]:
    latency = Histogram(LATENCY_BUCKETS_S)
    for seconds in (0.0004, 0.003, 0.003, 0.7, 42.0, 5000.0):
        for _ in range(scale):
            latency.observe(seconds)
    batches = Histogram(BATCH_BUCKETS)
    batches.observe(3)
    odd = 'a "quoted" back\\slash\nnewline'
    return [
        Family("gauge", "stepstream_build_info", "Always 1.", ["version", "b"], {("1.0", "x"): 1}),
        Family(
            "counter",
            "stepstream_steps",
            'Steps, "quoted" and back\\slashed,\nover two lines.',
            ["workflow", "step", "outcome"],
            {("w", odd, "succeeded"): 3 * scale, ("w", "s", "failed"): 0},
        ),
        Family("counter", "stepstream_rebalances", "Rebalances.", [], {(): 2_500_000 * scale}),
        Family("gauge", "stepstream_lag", "Lag.", ["partition"], {("0",): 0.5, ("1",): 1e21}),
        Family("gauge", "stepstream_empty", "No series.", ["partition"], {}),
        Family(
            "histogram",
            "stepstream_step_attempt_duration_seconds",
            "Attempts.",
            ["workflow", "step"],
            {("w", "charge"): latency, ("w", odd): Histogram(LATENCY_BUCKETS_S)},
        ),
        Family("histogram", "stepstream_commit_batch_records", "Batches.", [], {(): batches}),
    ]


def test_the_text_is_prometheus_clients_on_every_scrape() -> None:
    text = SeriesText()
    for scale in (1, 7, 400_000):  # the last: bucket counts past a million (Go's 1e+06)
        families = _families(scale)
        assert text.render(families) == _by_prometheus_client(families)


async def test_a_running_engines_families_are_rendered_as_prometheus_client_does(
    tmp_path: Path,
) -> None:
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from stepstream.ops.telemetry.metrics import Health, observability_for
    from stepstream.producers.client import Client
    from tests.conftest import test_registry

    config = EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    engine = await open_embedded(test_registry(), config)
    async with Client(engine.make_transport(owns_engine=True)) as client:
        observability = observability_for(engine.host, Health(lambda: True))
        assert observability.engine is not None
        for round_ in range(2):  # the second scrape reuses the kept line starts
            for i in range(3):
                await client.start("arith", i, instance_id=f"a-{round_}-{i}")
                await client.start("fatal", None, instance_id=f"f-{round_}-{i}")
            for i in range(3):
                await client.result(f"a-{round_}-{i}", timeout=30)
                with pytest.raises(WorkflowFailed):
                    await client.result(f"f-{round_}-{i}", timeout=30)
            registry = CollectorRegistry(auto_describe=False)
            registry.register(observability.engine)
            gc.disable()  # its pauses are a family: none may come between the two
            try:
                assert observability.engine.text() == generate_latest(registry).decode()
            finally:
                gc.enable()
        body = (await observability.render()).body.decode()
    names = {family.name for family in text_string_to_metric_families(body)}
    # The engine's families and the process's own, in one body.
    assert {"stepstream_steps", "stepstream_timer_lateness_seconds"} <= names, names
    assert {"process_cpu_seconds", "python_gc_objects_collected"} <= names, names
    assert 'stepstream_steps_total{outcome="succeeded",step="add",workflow="arith"} 6.0' in body
