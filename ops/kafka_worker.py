"""``stepstream worker``: the Kafka-mode worker process, assembled.

One worker = one member of the consumer group ``<prefix>.workers``: the partitions the
group gives it run in a ``PartitionHost`` (processors, timer services, step executor)
through ``consumers.kafka.KafkaRunner``; an HTTP API serves reads of those partitions and
tells ``kafka://`` clients when their commands are settled; its address and partitions
are announced on ``<prefix>.members`` whenever they change, and withdrawn (a tombstone)
when it stops cleanly. On start, before it joins the group, it registers the workflows it
runs on ``<prefix>.definitions``, so clients accept them even while no worker runs.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from urllib.parse import urlsplit

from aiohttp import web

from stepstream.consumers.host import PartitionHost
from stepstream.consumers.kafka import (
    KafkaRunner,
    LogProducer,
    OutRecord,
    StateDir,
    topic_partitions,
)
from stepstream.consumers.kafka.group_protocol import check_member_settings
from stepstream.consumers.kafka.keys import group_id
from stepstream.consumers.kafka.logins import LoginWatch
from stepstream.consumers.kafka.outbox import KafkaOutbox
from stepstream.consumers.kafka.topic_rules import log_findings
from stepstream.consumers.sources import SourceConsumer, SourceLag, kafka_sink
from stepstream.consumers.spans import Messaging
from stepstream.engine.api.sources import Source, declared_sources
from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import ConnectionFailed, StepstreamError
from stepstream.engine.seams import Clock, SystemClock
from stepstream.engine.wire.codec import JsonCodec, PayloadCodec
from stepstream.engine.wire.records import Command
from stepstream.engine.wire.serde import RecordSerde, default_serde
from stepstream.engine.wire.topics import DEFINITIONS, MEMBERS, TopicNames, partition_for
from stepstream.ops.api.routes import DEFAULT_MAX_BODY_BYTES, make_app
from stepstream.ops.api.serving import api_runner
from stepstream.ops.api.ui.cluster import ClusterView
from stepstream.ops.kafka_worker_config import ENV_EXIT_AFTER_LOGIN_REFUSED, KafkaWorkerConfig
from stepstream.ops.telemetry import tracing
from stepstream.ops.telemetry.metrics import Health, observability_for
from stepstream.ops.worker_reads import OwnedReader
from stepstream.producers import trace_context
from stepstream.producers.kafka.definitions import registrations
from stepstream.producers.kafka.members import Member
from stepstream.producers.publisher import LogTransport

log = logging.getLogger("stepstream.worker")


class KafkaWorker:
    """``await start()``, then ``await wait_assigned()`` if you need partitions now;
    ``await stop()`` leaves the group cleanly."""

    def __init__(
        self,
        registry: Registry,
        config: KafkaWorkerConfig,
        *,
        codec: PayloadCodec | None = None,
        clock: Clock | None = None,
        serde: RecordSerde | None = None,
        sources: Sequence[Source] | None = None,
    ) -> None:
        """``sources``: the topics to read as event sources; by default the ``Source``
        objects declared in the modules of the registry's workflows."""
        self.registry = registry
        self._declared = sources
        self.config = config
        self._codec = codec or JsonCodec()
        self._clock = clock or SystemClock()
        self._serde = serde or default_serde()
        self._topics = TopicNames(config.settings.prefix)
        self._state_dir: StateDir | None = None
        self._producer: LogProducer | None = None
        # Whether Kafka still accepts the worker's login (refused: not ready, and why).
        self.logins = LoginWatch(config.settings.bootstrap)
        self._outbox: KafkaOutbox | None = None
        self._host: PartitionHost | None = None
        self._runner: KafkaRunner | None = None
        self._sources: SourceConsumer | None = None
        self._http: web.AppRunner | None = None
        self._ui = ClusterView(
            config.settings,
            token=config.api.token,
            codec=self._codec,
            max_payload_bytes=config.max_payload_bytes,
        )
        self._changed = asyncio.Event()
        self._stopped = asyncio.Event()
        self.url = ""
        self.failed: BaseException | None = None
        self._announced = 0
        self._watching: asyncio.Task[None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        settings = self.config.settings
        self.config.api.check_bind(self.config.host)
        check_member_settings(settings)  # a refused group setting: before any side effect
        try:
            partitions = await asyncio.to_thread(topic_partitions, settings)
            # Settings that break a guarantee (history deleted by age, one replica...) are
            # logged as warnings, as `stepstream topics check` prints them; never fatal.
            await asyncio.to_thread(log_findings, settings)
            self._state_dir = StateDir.claim(
                self.config.state_dir, settings.prefix, self.config.rocksdb_memory
            )
            worker_id = self._state_dir.worker_id
            self._producer = await asyncio.to_thread(
                LogProducer,
                settings,
                client_id=f"stepstream-worker-{worker_id[:8]}",
                logins=self.logins,
            )
            outbox_bootstrap = self.config.outbox_bootstrap or settings.bootstrap
            self._outbox = KafkaOutbox(
                replace(settings, bootstrap=outbox_bootstrap),
                client_id=f"stepstream-outbox-{worker_id[:8]}",
            )
            self._host = PartitionHost(
                self.registry,
                partitions=partitions,
                serde=self._serde,
                codec=self._codec,
                clock=self._clock,
                max_payload_bytes=self.config.max_payload_bytes,
                config=self.config.processor,
                outbox=self._outbox,
            )
            # The workers' spans name the topic and group their commands come from.
            self._host.telemetry.messaging = Messaging(
                "kafka", TopicNames(settings.prefix).commands, group_id(settings.prefix)
            )
            if self.config.span_sink is not None:
                self._host.telemetry.spans = self.config.span_sink
            elif self.config.tracer_provider is not None:
                tracing.install(self._host, self.config.tracer_provider)
            await self._register(worker_id)
            await self._serve(self._host)
            self._runner = KafkaRunner(
                settings,
                self._host,
                state_dir=self._state_dir,
                producer=self._producer,
                serde=self._serde,
                clock=self._clock,
                on_owned=self._announce,
                on_fatal=self._fatal,
                snapshot_every=self.config.snapshot_every,
                logins=self.logins,
            )
            await self._runner.start()
            await self._start_sources(partitions)
            if self.config.exit_after_login_refused_s > 0:
                self._watching = asyncio.get_running_loop().create_task(self._exit_if_locked_out())
        except BaseException:
            await self.stop()
            raise
        log.info(
            "worker started",
            extra={
                "worker_id": worker_id,
                "url": self.url,
                "prefix": settings.prefix,
                "partitions": partitions,
            },
        )

    async def wait_assigned(self, partitions: int | None = None, timeout: float = 60.0) -> None:
        """Wait until the group gave this worker its first assignment (and it announced
        it), or, with ``partitions``, until it owns that many partitions."""
        async with asyncio.timeout(timeout):
            while (
                self._announced == 0
                if partitions is None
                else len(self.owned) != partitions or self._announced == 0
            ):
                if self.failed is not None:
                    raise StepstreamError(f"the worker failed: {self.failed}")
                self._changed.clear()
                await self._changed.wait()

    async def run(self) -> None:
        """Until ``stop()`` or a fatal error (raised)."""
        await self._stopped.wait()
        if self.failed is not None:
            raise StepstreamError(f"the worker stopped after a fatal error: {self.failed}")

    async def stop(self) -> None:
        """Leave the group (owned partitions are revoked and handed over), withdraw the
        announcement, stop serving."""
        if self._watching is not None:
            self._watching.cancel()
            self._watching = None
        if self._sources is not None:
            await self._sources.stop()  # first: it produces with the producer closed below
            self._sources = None
        if self._runner is not None:
            await self._runner.stop()
            self._runner = None
        if self._producer is not None and self._state_dir is not None and self.url:
            try:
                await self._producer.send(
                    [
                        OutRecord(
                            self._topics.name(MEMBERS), 0, self._state_dir.worker_id.encode(), None
                        )
                    ]
                )
            except StepstreamError as exc:
                log.warning("could not withdraw this worker's announcement: %s", exc)
        if self._http is not None:
            await self._http.cleanup()
            self._http = None
        await self._ui.close()
        if self._host is not None:
            await self._host.close()
        if self._outbox is not None:
            await asyncio.to_thread(self._outbox.close)
            self._outbox = None
        if self._producer is not None:
            await asyncio.to_thread(self._producer.close)
            self._producer = None
        if self._state_dir is not None:
            self._state_dir.release()
            self._state_dir = None
        self._stopped.set()
        self._changed.set()

    async def _start_sources(self, partitions: int) -> None:
        """Consume the topics the workflow modules declare as ``Source`` (if any)."""
        sources = (
            declared_sources(self.registry) if self._declared is None else list(self._declared)
        )
        if not sources:
            return
        assert self._producer is not None
        self._sources = SourceConsumer(
            self.config.settings,
            sources,
            sink=kafka_sink(self._producer, self.config.settings.prefix, partitions),
            serde=self._serde,
            codec=self._codec,
            clock=self._clock,
            max_payload_bytes=self.config.max_payload_bytes,
            config=self.config.sources,
            on_fatal=self._fatal,
        )
        await self._sources.start()

    @property
    def source_lag(self) -> SourceLag | None:
        """Records of the source topics not yet turned into durable commands, per topic
        partition this worker reads (``stepstream_source_lag_records``); None without
        sources."""
        return self._sources.lag if self._sources is not None else None

    # ---- what it owns -----------------------------------------------------------------

    @property
    def host(self) -> PartitionHost:
        if self._host is None:
            raise StepstreamError("the worker is not started; await worker.start() first")
        return self._host

    @property
    def owned(self) -> dict[int, int]:
        """Partition -> the epoch this worker owns it with."""
        return self._runner.owned if self._runner is not None else {}

    @property
    def worker_id(self) -> str:
        return self._state_dir.worker_id if self._state_dir is not None else ""

    async def _register(self, worker_id: str) -> None:
        assert self._producer is not None
        topic = self._topics.name(DEFINITIONS)
        records = [
            OutRecord(topic, 0, r.key, r.encode())
            for r in registrations(self.registry, worker_id, self._clock.now_ms())
        ]
        await self._producer.send(records)
        log.info(
            "registered workflows on %s", topic, extra={"workflows": sorted(self.registry.names())}
        )

    async def _announce(self, owned: dict[int, int]) -> None:
        assert self._producer is not None and self._state_dir is not None
        member = Member(
            worker_id=self._state_dir.worker_id,
            url=self.url,
            partitions=tuple(sorted(owned)),
            epoch=max(owned.values(), default=0),
            partition_count=self.host.partitions,
            max_payload_bytes=self.config.max_payload_bytes,
            time_ms=self._clock.now_ms(),
        )
        await self._producer.send(
            [OutRecord(self._topics.name(MEMBERS), 0, member.worker_id.encode(), member.encode())]
        )
        log.info(
            "announced its partitions",
            extra={"partitions": list(member.partitions), "url": self.url},
        )
        self._announced += 1
        self._changed.set()

    async def _exit_if_locked_out(self) -> None:
        limit = self.config.exit_after_login_refused_s
        while self.logins.refused_for() < limit:
            await asyncio.sleep(min(1.0, limit / 4))
        self._fatal(StepstreamError(self.logins.giving_up(limit, ENV_EXIT_AFTER_LOGIN_REFUSED)))

    def _fatal(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = exc
            log.error("worker failing: %s", exc)
        self._stopped.set()
        self._changed.set()

    # ---- the HTTP API --------------------------------------------------------------------

    def _ready(self) -> bool:
        return (
            self.failed is None
            and not self.logins.failing
            and self._runner is not None
            and self._runner.ready
        )

    def _not_ready_reason(self) -> str:
        if self.failed is not None:
            return f"the worker is failing: {self.failed}"
        refused = self.logins.reason()
        if refused is not None:
            return refused
        if self._runner is None:
            return "not started"
        since = self._runner.unreachable_since
        if since is not None:
            when = datetime.fromtimestamp(since, UTC).isoformat(timespec="seconds")
            return (
                f"no Kafka broker at {self.config.settings.bootstrap} is reachable (since "
                f"{when}); the worker goes on by itself once one is: check the brokers "
                "and the network between them and this worker"
            )
        return "waiting for the consumer group to assign partitions, or restoring the assigned ones"

    async def _publish(self, command: Command) -> None:
        """Commands sent to this worker's API (``--connect http://worker``) for the
        partitions it owns; a kafka:// client publishes its own."""
        host = self.host
        if not host.owns(command.instance_id):
            partition = partition_for(command.instance_id, host.partitions)
            raise ConnectionFailed(
                f"instance {command.instance_id} is on partition {partition}, which this "
                "worker does not own; use a kafka:// client (it publishes to Kafka itself)"
            )
        assert self._producer is not None
        await self._producer.send(
            [
                OutRecord(
                    self._topics.commands,
                    partition_for(command.instance_id, host.partitions),
                    command.instance_id.encode(),
                    self._serde.encode(command),
                    trace_context.record_headers(command.traceparent, command.tracestate),
                )
            ]
        )

    async def _serve(self, host: PartitionHost) -> None:
        reader = OwnedReader(host)
        transport = LogTransport(
            self._publish,
            reader,
            codec=self._codec,
            max_payload_bytes=self.config.max_payload_bytes,
            clock=self._clock,
            destination=trace_context.Destination(
                "kafka", TopicNames(self.config.settings.prefix).commands
            ),
        )
        security = self.config.api
        advertised = urlsplit(self.config.advertise).hostname if self.config.advertise else None
        app = make_app(
            transport,
            registry_names=self.registry.names,
            max_body_bytes=max(DEFAULT_MAX_BODY_BYTES, 2 * self.config.max_payload_bytes),
            commands=reader,
            security=security,
            served_hosts=(self.config.host, *([advertised] if advertised else [])),
            observability=observability_for(
                host,
                Health(ready=self._ready, reason=self._not_ready_reason),
                rebalances=lambda: self._runner.rebalances if self._runner is not None else 0,
                source_lag=lambda: self.source_lag.records() if self.source_lag else {},
                backend="kafka",
                logins=lambda: (self.logins.failing, self.logins.refusals_total),
            ),
            ui_transport=self._ui.transport,
            limits=self.config.api_limits,
        )
        tls = security.ssl_context()
        # No access log: on Kubernetes the probes and scrapes would fill it, and
        # stepstream_http_requests_total counts requests by route.
        runner = api_runner(app, access_log=False)
        await runner.setup()
        host_name, port = self.config.host, self.config.port
        try:
            site = web.TCPSite(runner, host_name, port, reuse_address=True, ssl_context=tls)
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise StepstreamError(
                f"cannot listen on {host_name}:{port}: {exc.strerror or exc}; pass another "
                "--port (0 for any) or stop what is using it"
            ) from None
        self._http = runner
        bound_host, bound_port = runner.addresses[0][:2]
        self.url = self.config.advertise or _url(security.scheme, bound_host, bound_port)


def _url(scheme: str, host: str, port: int) -> str:
    if host in ("0.0.0.0", "::"):
        host = socket.gethostname()
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
