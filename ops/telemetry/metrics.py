"""Prometheus metrics of a serving process (``stepstream dev``, ``stepstream worker``) and
the ``/metrics`` and ``/readyz`` routes.

Nothing is counted here: the engine keeps plain counters and histograms in its
``Telemetry`` (cheap on the hot path) and the gauges are read from the partitions it
owns; this collector turns them into metric families when Prometheus scrapes, and
``exposition.py`` writes those as text (a scrape holds the event loop, so it must stay
cheap: the bench's ``--scrape-interval`` measures it). Names follow Prometheus'
conventions: ``stepstream_`` prefix, units in the name, counters end in ``_total``,
durations are histograms in seconds. No label carries an instance id.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from stepstream.consumers import rocks_memory
from stepstream.consumers.host import PartitionHost
from stepstream.consumers.telemetry import DEAD_LETTER_REASONS
from stepstream.engine.version import version
from stepstream.ops.api.limits import Pending
from stepstream.ops.telemetry import gc_pauses
from stepstream.ops.telemetry.api_metrics import ApiCollector, SessionCounts
from stepstream.ops.telemetry.exposition import Family, SeriesText
from stepstream.ops.telemetry.gc_pauses import GcPauses
from stepstream.ops.telemetry.http_metrics import HttpMetrics
from stepstream.ops.telemetry.schedule_metrics import ScheduleCollector
from stepstream.ops.telemetry.span_export import DROP_REASONS, SpanExportProcess

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

SourceLagReader = Callable[[], Mapping[tuple[str, int], int]]
# (whether Kafka refuses the worker's login now, refusals counted since it started).
LoginReader = Callable[[], tuple[bool, int]]


@dataclass(frozen=True)
class Health:
    """What ``/readyz`` asks: ready once every owned partition is restored (and, on
    Kafka, the worker is in the group and lost nothing since)."""

    ready: Callable[[], bool]
    # Why it is not ready, for the probe's body and an operator reading it.
    reason: Callable[[], str] = lambda: "partitions are being restored"


class EngineCollector(Collector):
    def __init__(
        self,
        host: PartitionHost,
        *,
        health: Health,
        rebalances: Callable[[], int] = lambda: 0,
        source_lag: SourceLagReader | None = None,
        gc_pauses: GcPauses | None = None,
        backend: str = "embedded",
        logins: LoginReader = lambda: (False, 0),
    ) -> None:
        self._gc_pauses = gc_pauses
        self._logins = logins
        self._build = {
            "version": version(),
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "backend": backend,
        }
        self._host = host
        self._health = health
        self._rebalances = rebalances
        self._source_lag = source_lag
        self._text = SeriesText()

    def collect(self) -> Iterator[Metric]:
        for family in self.families():
            yield family.metric()

    def text(self) -> str:
        """Every family as exposition text (what ``collect`` gives, rendered cheaply)."""
        return self._text.render(self.families())

    def families(self) -> Iterator[Family]:
        t = self._host.telemetry
        build = self._build
        yield Family(
            "gauge",
            "stepstream_build_info",
            "Always 1; its labels say which stepstream (version), Python and backend "
            "this process runs.",
            list(build),
            {tuple(build.values()): 1},
        )
        yield Family(
            "counter",
            "stepstream_commands_applied",
            "Commands applied by the partition processors, by command type.",
            ["type"],
            {(kind,): n for kind, n in t.commands.items()},
        )
        yield Family(
            "counter",
            "stepstream_workflows",
            "Workflow instances started and finished, by workflow and outcome "
            "(started, completed, failed, cancelled, terminated).",
            ["workflow", "outcome"],
            t.workflows,
        )
        yield Family(
            "counter",
            "stepstream_steps",
            "Step attempts that ended, by workflow, step and outcome (succeeded, retried, "
            "timed_out: retried after its timeout, failed: the step gave up, cancelled).",
            ["workflow", "step", "outcome"],
            t.steps,
        )
        yield Family(
            "histogram",
            "stepstream_step_attempt_duration_seconds",
            "Step attempts from their durable start to their durable outcome.",
            ["workflow", "step"],
            t.step_seconds,
        )
        yield Family(
            "histogram",
            "stepstream_workflow_duration_seconds",
            "Workflow instances from their start to their end, by outcome.",
            ["workflow", "outcome"],
            t.workflow_seconds,
        )
        yield Family(
            "histogram",
            "stepstream_workflow_schedule_to_start_seconds",
            "From a start command's acceptance (the time its client stamped on it) to its "
            "instance's start being applied by the partition's owner.",
            ["workflow"],
            {(w,): h for w, h in t.start_delay_seconds.items()},
        )
        yield Family(
            "histogram",
            "stepstream_step_schedule_to_start_seconds",
            "From a step attempt becoming due (the code reached the step, or its retry "
            "backoff ended) to the attempt being started.",
            ["workflow", "step"],
            t.step_delay_seconds,
        )
        yield Family(
            "histogram",
            "stepstream_timer_lateness_seconds",
            "How long after its due time a timer fire was applied.",
            [],
            {(): t.timer_lateness},
        )
        yield Family(
            "counter",
            "stepstream_timers_fired",
            "Timer fires applied, by path: direct (handed by the partition's timer service "
            "to its processor, which had applied every command) or log (through the "
            "commands topic, when the processor was behind).",
            ["path"],
            {(path,): n for path, n in t.timers_fired.items()},
        )
        yield Family(
            "histogram",
            "stepstream_commit_batch_records",
            "Records appended per commit (group commit batch size).",
            [],
            {(): t.commit_records},
        )
        yield Family(
            "histogram",
            "stepstream_commit_duration_seconds",
            "How long a commit took to become durable.",
            [],
            {(): t.commit_seconds},
        )
        yield Family(
            "histogram",
            "stepstream_replay_duration_seconds",
            "How long replaying a workflow's code over its history took (after an "
            "eviction from the cache or a restart).",
            [],
            {(): t.replay_seconds},
        )
        yield Family(
            "gauge",
            "stepstream_restore_duration_seconds",
            "How long the last restore of each partition owned here took.",
            ["partition"],
            {(str(p),): s for p, s in t.restore_seconds.items()},
        )
        yield Family(
            "counter",
            "stepstream_instance_cache_hits",
            "Inputs whose instance runtime was in memory.",
            [],
            {(): t.cache_hits},
        )
        yield Family(
            "counter",
            "stepstream_instance_cache_misses",
            "Inputs whose instance had to be loaded (and its code replayed).",
            [],
            {(): t.cache_misses},
        )
        yield Family(
            "counter",
            "stepstream_instances_set_apart",
            "Instances whose decisions could not be stored (a value no record holds): "
            "their inputs are refused until the process restarts; the log names each.",
            [],
            {(): t.set_apart},
        )
        yield Family(
            "counter",
            "stepstream_dead_letters",
            "Records written to the dead-letters topic, by reason.",
            ["reason"],
            {(reason,): t.dead_letters[reason] for reason in DEAD_LETTER_REASONS},
        )
        sizes = t.queues.sizes()
        yield Family(
            "gauge",
            "stepstream_queue_waiting",
            "Instances and step calls waiting for a slot, by queue (the queues whose "
            "partition this process owns; a per_key queue's keys summed).",
            ["queue"],
            {(q,): w for q, (w, _) in sizes.items()},
        )
        yield Family(
            "gauge",
            "stepstream_queue_running",
            "Slots held (admitted, not released yet), by queue.",
            ["queue"],
            {(q,): r for q, (_, r) in sizes.items()},
        )
        yield Family(
            "histogram",
            "stepstream_queue_admission_wait_seconds",
            "From a request for a slot reaching its queue to its admission, by queue.",
            ["queue"],
            {(q,): h for q, h in t.queues.admission_wait_seconds.items()},
        )
        gauges = self._host.gauges()
        yield Family(
            "gauge",
            "stepstream_timers_pending",
            "Timers scheduled and not fired yet, per partition.",
            ["partition"],
            {(str(g.partition),): g.timers_pending for g in gauges},
        )
        yield Family(
            "gauge",
            "stepstream_timers_held",
            "Pending timers held in memory (the soonest due) per partition; the others "
            "are read back from the index as these fire.",
            ["partition"],
            {(str(g.partition),): g.timers_held for g in gauges},
        )
        yield Family(
            "gauge",
            "stepstream_rocksdb_memory_bytes",
            "Memory RocksDB holds within its budget in this process: cached blocks and "
            "the write buffers (memtables) charged to the cache.",
            [],
            {(): rocks_memory.usage_bytes()},
        )
        yield Family(
            "gauge",
            "stepstream_rocksdb_memory_limit_bytes",
            "The budget this process's RocksDB databases share (STEPSTREAM_ROCKSDB_MEMORY_MB).",
            [],
            {(): rocks_memory.limit_bytes()},
        )
        yield Family(
            "gauge",
            "stepstream_instance_cache_size",
            "Instance runtimes held in memory.",
            [],
            {(): sum(g.cached_instances for g in gauges)},
        )
        yield Family(
            "gauge",
            "stepstream_parked_instances",
            "Unfinished instances parked: their history diverged from the deployed code, "
            "or their version is not deployed (stepstream list --diverged).",
            [],
            {(): sum(g.parked_instances for g in gauges)},
        )
        yield Family(
            "gauge",
            "stepstream_consumer_lag_records",
            "Commands on each owned partition not yet applied.",
            ["partition"],
            {(str(g.partition),): g.lag for g in gauges},
        )
        lag = self._source_lag() if self._source_lag is not None else {}
        yield Family(
            "gauge",
            "stepstream_source_lag_records",
            "Records of event-source topics not yet turned into commands.",
            ["topic", "partition"],
            {(topic, str(p)): n for (topic, p), n in lag.items()},
        )
        yield Family(
            "counter",
            "stepstream_rebalances",
            "Consumer-group rebalances this worker took part in.",
            [],
            {(): self._rebalances()},
        )
        yield Family(
            "gauge",
            "stepstream_partitions_owned",
            "Partitions this process owns.",
            [],
            {(): len(gauges)},
        )
        yield Family(
            "gauge",
            "stepstream_partition_owned",
            "1 for each partition this process owns (restored and processing); a "
            "partition owned elsewhere has no series here.",
            ["partition"],
            {(str(g.partition),): 1 for g in gauges},
        )
        yield Family(
            "gauge",
            "stepstream_ready",
            "1 when every owned partition is restored and the process serves them.",
            [],
            {(): 1 if self._health.ready() else 0},
        )
        refusing, refusals = self._logins()
        yield Family(
            "gauge",
            "stepstream_kafka_login_refused",
            "1 while Kafka refuses this worker's SASL login or TLS handshake (a credential "
            "rotated or deleted on the brokers while it ran); 0 otherwise and embedded.",
            [],
            {(): 1 if refusing else 0},
        )
        yield Family(
            "counter",
            "stepstream_kafka_login_refusals",
            "Logins and TLS handshakes Kafka refused this worker's clients while it ran "
            "(each reconnect that was refused).",
            [],
            {(): refusals},
        )
        spans = self._host.telemetry.spans
        dropped = (
            spans.spans_dropped()
            if isinstance(spans, SpanExportProcess)
            else dict.fromkeys(DROP_REASONS, 0)
        )
        yield Family(
            "counter",
            "stepstream_spans_dropped",
            "Spans not exported, by reason: the exporter fell behind (backlog) or the "
            "OTLP/HTTP endpoint failed or refused them (export_failed; other exporters "
            "report their own failures in the log). 0 with tracing off.",
            ["reason"],
            {(reason,): n for reason, n in dropped.items()},
        )
        pauses = self._gc_pauses
        if pauses is not None:
            yield Family(
                "histogram",
                "stepstream_gc_pause_seconds",
                "How long the garbage collector stopped this process (and its event "
                "loop), by generation (2 is a full collection).",
                ["generation"],
                {(str(g),): h for g, h in enumerate(pauses.seconds)},
            )
            yield Family(
                "gauge",
                "stepstream_gc_pause_max_seconds",
                "The longest pause of the garbage collector since the process started, "
                "by generation.",
                ["generation"],
                {(str(g),): s for g, s in enumerate(pauses.longest)},
            )


def metrics_registry() -> CollectorRegistry:
    """A registry of its own (not the process-wide default), so two engines in one
    process (tests, an embedding application) never collide; with the process's own
    collectors (``process_*``: CPU, memory, file descriptors; ``python_*``: the
    interpreter, its garbage collector). In ``stepstream dev --processes N`` each process
    serves its own, and process 0 labels each process's series with ``process``."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


@dataclass(frozen=True)
class Rendered:
    """One scrape's body and the milliseconds it held the event loop."""

    body: bytes
    loop_ms: float


@dataclass(frozen=True)
class Observability:
    """What a server adds to its API: ``/metrics``, ``/readyz``, and (``http``) the
    middleware that counts its requests onto the same registry.

    ``/metrics`` is the engine's families (``engine``, rendered by ``exposition.py``: the
    bulk of a scrape, made cheap because it holds the event loop) followed by what
    prometheus_client renders from ``registry`` (the process's own collectors, the API's,
    the schedules')."""

    registry: CollectorRegistry
    health: Health
    http: HttpMetrics | None = None
    engine: EngineCollector | None = None

    async def render(self) -> Rendered:
        """The exposition text, and how long making it held the event loop."""
        began = time.perf_counter()
        engine = self.engine.text().encode() if self.engine is not None else b""
        body = engine + generate_latest(self.registry)
        return Rendered(body, (time.perf_counter() - began) * 1000)

    async def metrics(self, request: web.Request) -> web.Response:
        rendered = await self.render()
        # Server-Timing (W3C): what a scrape cost the engine's loop, for `stepstream bench
        # --scrape-interval` and anyone curious; Prometheus ignores it.
        headers = {
            "Content-Type": CONTENT_TYPE,
            "Server-Timing": f"loop;dur={rendered.loop_ms:.3f}",
        }
        return web.Response(body=rendered.body, headers=headers)

    async def readyz(self, request: web.Request) -> web.Response:
        if self.health.ready():
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "reason": self.health.reason()}, status=503)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/readyz", self.readyz)

    def count_api(self, pending: Pending, sessions: SessionCounts) -> None:
        """Serve the API's pending calls, refusals and session traffic: for the API
        clients use (the one that counts HTTP requests), not the engine processes'
        internal one, which shares the registry and whose calls process 0 counted."""
        if self.http is not None:
            self.registry.register(ApiCollector(pending, sessions))


def observability_for(
    host: PartitionHost,
    health: Health,
    *,
    rebalances: Callable[[], int] = lambda: 0,
    source_lag: SourceLagReader | None = None,
    backend: str = "embedded",
    logins: LoginReader = lambda: (False, 0),
) -> Observability:
    collector = EngineCollector(
        host,
        health=health,
        rebalances=rebalances,
        source_lag=source_lag,
        gc_pauses=gc_pauses.recording(),
        backend=backend,
        logins=logins,
    )
    registry = metrics_registry()
    registry.register(ScheduleCollector(host))
    http = HttpMetrics()
    registry.register(http)
    return Observability(registry, health, http, collector)
