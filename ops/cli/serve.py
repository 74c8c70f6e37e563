"""The serving commands: ``stepstream dev`` (the embedded engine, its API and web UI in
one process, or in N) and ``stepstream worker`` (a member of a Kafka consumer group)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web

from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.ops import event_loop
from stepstream.ops.api.routes import DEFAULT_MAX_BODY_BYTES, make_app
from stepstream.ops.api.security import ApiSecurity
from stepstream.ops.api.serving import address, api_runner, cut_off, reachable
from stepstream.ops.api.serving import listen as _listen
from stepstream.ops.api.serving import stop_on_signals as _stop_on_signals
from stepstream.ops.cli import render
from stepstream.ops.cli.options import (
    CODEC,
    JSON,
    KAFKA,
    SERVING,
    api_limits,
    api_security,
    codec_from_args,
    kafka_settings,
)
from stepstream.ops.cli.options import put_cwd_on_path as _put_cwd_on_path
from stepstream.ops.cli.table import EXIT_ERROR, EXIT_OK, Command, UsageError, arg
from stepstream.ops.gc_tuning import WORKER_THRESHOLDS, tune_for_serving
from stepstream.ops.telemetry import tracing
from stepstream.ops.telemetry.metrics import Health, observability_for

log = logging.getLogger("stepstream.cli")

_PROCESS_TUNING = (
    "It runs on uvloop, libuv's event loop ($STEPSTREAM_EVENT_LOOP=asyncio: the standard "
    "library's), with the garbage collector's thresholds raised ($STEPSTREAM_GC=default: "
    "Python's own). Its RocksDB databases share one memory budget for cached blocks and "
    "write buffers, $STEPSTREAM_ROCKSDB_MEMORY_MB (default 64). Once retention has "
    "forgotten $STEPSTREAM_MALLOC_TRIM_AFTER instances (default 1000; 0: never) it gives "
    "the memory they freed back to the system (glibc's malloc_trim)."
)
_OBSERVED = (
    " It serves Prometheus metrics at /metrics (with the API token when one is set): "
    "stepstream_* (work done, latencies, schedule-to-start, HTTP requests by route, "
    "API calls pending against --max-pending and refused, partitions owned, build "
    "info) and the process_* and python_* collectors; "
    "docs/operations.md lists them. /healthz and /readyz are its probes."
)


def _announce(args: argparse.Namespace, text: str, facts: dict[str, Any]) -> None:
    """The one line a server prints once it listens (tests and scripts wait for it):
    ``text``, or with ``--json`` the same facts as one JSON object."""
    if args.json:
        render.print_json(facts, one_line=True)
    else:
        print(text, flush=True)


def _log_serving(url: str, security: ApiSecurity) -> None:
    """What a serving process logs once it listens at ``url``: where its web UI is (a
    URL a browser can open: the public one behind a proxy) and the event loop it runs on."""
    log.info("web UI at %s/ui", security.public_url() or reachable(url))
    log.info("event loop running", extra={"event_loop": event_loop.running_loop_name()})


def _workflow_names(registry: Registry) -> str:
    return ", ".join(f"{name} v{'/'.join(versions)}" for name, versions in registry.names().items())


# ---- dev ------------------------------------------------------------------------------


def _dev(args: argparse.Namespace) -> int:
    _put_cwd_on_path()
    registry = Registry()
    registry.add_modules(args.workflows)
    codec = codec_from_args(args)
    tune_for_serving()
    return event_loop.run(_serve(registry, args, codec))


async def _serve(registry: Registry, args: argparse.Namespace, codec: PayloadCodec | None) -> int:
    from stepstream.ops import processes
    from stepstream.ops.embedded import EmbeddedConfig, open_embedded
    from stepstream.ops.embedded_sources import start_embedded_sources

    if args.partitions is not None and args.partitions < 1:
        raise UsageError(f"--partitions must be 1 or more, got {args.partitions}")
    config = EmbeddedConfig.from_env(data_dir=args.data, partitions=args.partitions)
    if args.processes < 1:
        raise UsageError(f"--processes must be 1 or more, got {args.processes}")
    if args.hang_timeout is not None:
        if args.processes == 1:
            raise UsageError("--hang-timeout watches the engine processes of --processes 2 or more")
        if not (args.hang_timeout == 0 or 1 <= args.hang_timeout < float("inf")):
            raise UsageError(
                f"--hang-timeout must be 0 (never) or 1 second or more, got {args.hang_timeout}"
            )
    security = api_security(args)
    limits = api_limits(args)
    tls = security.ssl_context()
    spec = os.environ.get(processes.SPEC_ENV)
    if spec:  # one of the engine processes of a `stepstream dev --processes N`
        return await processes.serve_child(
            registry,
            config,
            processes.Spec.from_env(spec),
            _public_app(args, config, security),
            tls,
            codec=codec,
        )
    if args.processes > 1:
        return await _serve_processes(registry, args, config, security, codec)
    sock = _listen(args.host, args.port)
    engine = await open_embedded(registry, config, codec=codec)
    traced = tracing.setup(engine.host, service="stepstream-dev")
    sources = None
    try:
        sources = await start_embedded_sources(registry, engine)
        app = make_app(
            engine.transport,
            registry_names=engine.host.registry.names,
            # Leave room above the payload limit so an oversized payload gets the
            # engine's precise message rather than a bare body-size refusal.
            max_body_bytes=max(DEFAULT_MAX_BODY_BYTES, 2 * config.max_payload_bytes),
            security=security,
            served_hosts=(args.host,),
            limits=limits,
            observability=observability_for(
                engine.host,
                Health(
                    ready=lambda: engine.db.failure is None,
                    reason=lambda: f"the data directory failed: {engine.db.failure}",
                ),
                source_lag=lambda: sources.lag.records() if sources is not None else {},
            ),
        )
        # One process: a client asking where each serves (it does on connect) is told so,
        # and the server logs no 404 for it.
        processes.add_processes_route(
            app, processes.ProcessLayout(1, engine.host.partitions), [sock.getsockname()[1]]
        )
        runner = api_runner(app)
        await runner.setup()
        with _stop_on_signals() as stop:
            try:
                await web.SockSite(runner, sock, ssl_context=tls).start()
                url = f"{security.scheme}://{address(sock)}"
                _announce(
                    args,
                    f"stepstream dev listening on {url} (data {config.data_dir}, "
                    f"{engine.host.partitions} partitions, workflows: "
                    f"{_workflow_names(registry)})",
                    {
                        "listening": url,
                        "data": str(config.data_dir),
                        "partitions": engine.host.partitions,
                        "processes": 1,
                        "workflows": registry.names(),
                    },
                )
                _log_serving(url, security)
                # A full or damaged disk stops the engine: it says why and what to do.
                signalled = asyncio.ensure_future(stop.wait())
                failed = asyncio.ensure_future(engine.db.failed())
                await asyncio.wait({signalled, failed}, return_when=asyncio.FIRST_COMPLETED)
                for task in (signalled, failed):
                    task.cancel()
                if failed.done() and not failed.cancelled():
                    await cut_off(runner)
                    raise failed.result()
                log.info("shutting down", extra={"url": url})
            finally:
                await runner.cleanup()
    finally:
        sock.close()
        if sources is not None:
            await sources.stop()
        await engine.close()
        if traced is not None:
            traced.close()  # exports the spans still batched
    return EXIT_OK


def _public_app(
    args: argparse.Namespace, config: Any, security: ApiSecurity
) -> Callable[[Any, Any, Any], web.Application]:
    """How an engine process of `stepstream dev --processes N` makes the API clients use."""
    limits = api_limits(args)

    def public_app(transport: Any, engine: Any, observability: Any) -> web.Application:
        return make_app(
            transport,
            registry_names=engine.host.registry.names,
            max_body_bytes=max(DEFAULT_MAX_BODY_BYTES, 2 * config.max_payload_bytes),
            security=security,
            served_hosts=(args.host,),
            observability=observability,
            limits=limits,
        )

    return public_app


async def _serve_processes(
    registry: Registry,
    args: argparse.Namespace,
    config: Any,
    security: ApiSecurity,
    codec: PayloadCodec | None,
) -> int:
    from stepstream.ops import processes

    public_app = _public_app(args, config, security)

    def announce(address: str, layout: processes.ProcessLayout) -> None:
        url = f"{security.scheme}://{address}"
        _announce(
            args,
            f"stepstream dev listening on {url} (data {config.data_dir}, "
            f"{layout.partitions} partitions in {layout.processes} processes, workflows: "
            f"{_workflow_names(registry)})",
            {
                "listening": url,
                "data": str(config.data_dir),
                "partitions": layout.partitions,
                "processes": layout.processes,
                "workflows": registry.names(),
            },
        )
        _log_serving(url, security)

    sock = _listen(args.host, args.port)
    try:
        return await processes.serve_parent(
            registry,
            config,
            args.processes,
            sock,
            public_app,
            security.ssl_context(),
            announce,
            codec=codec,
            hang_timeout=(
                processes.HANG_TIMEOUT_S if args.hang_timeout is None else args.hang_timeout
            ),
        )
    finally:
        sock.close()


# ---- worker ---------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> int:
    _put_cwd_on_path()
    registry = Registry()
    registry.add_modules(args.workflows)
    codec = codec_from_args(args)
    tune_for_serving(default=WORKER_THRESHOLDS)
    return event_loop.run(_run_worker(registry, args, codec))


async def _run_worker(
    registry: Registry, args: argparse.Namespace, codec: PayloadCodec | None
) -> int:
    from stepstream.ops.kafka_worker import KafkaWorker
    from stepstream.ops.kafka_worker_config import KafkaWorkerConfig

    settings = kafka_settings(args)
    traced = tracing.from_env(service="stepstream-worker")
    config = KafkaWorkerConfig.from_env(
        settings,
        state_dir=args.state_dir,
        host=args.host,
        port=args.port,
        advertise=args.advertise,
        api=api_security(args),
        api_limits=api_limits(args),
        span_sink=traced.exporter if traced is not None else None,
    )
    worker = KafkaWorker(registry, config, codec=codec)
    await worker.start()
    with _stop_on_signals() as signalled:
        try:
            _announce(
                args,
                f"stepstream worker listening on {worker.url} (prefix {settings.prefix}, "
                f"{worker.host.partitions} partitions, state {config.state_dir}, "
                f"workflows: {_workflow_names(registry)})",
                {
                    "listening": worker.url,
                    "prefix": settings.prefix,
                    "partitions": worker.host.partitions,
                    "state": str(config.state_dir),
                    "workflows": registry.names(),
                },
            )
            _log_serving(worker.url, config.api)
            stop = asyncio.ensure_future(signalled.wait())
            failed = asyncio.ensure_future(worker.run())
            await asyncio.wait({stop, failed}, return_when=asyncio.FIRST_COMPLETED)
            for task in (stop, failed):
                task.cancel()
            if failed.done() and not failed.cancelled() and failed.exception() is not None:
                raise StepstreamError(str(failed.exception()))
            log.info("shutting down", extra={"url": worker.url})
        finally:
            bound = config.processor.drain_timeout_s + STOP_GRACE_S
            why = None
            if worker.failed is not None and worker.logins.failing:
                # Leaving the group, draining and withdrawing need the brokers, which
                # refuse this worker: a few seconds, then exit as after kill -9.
                bound = LOCKED_OUT_STOP_S
                why = f"the worker stopped after a fatal error: {worker.failed}"
            with _exit_if_stuck(bound, why=why):
                await worker.stop()
            if traced is not None:
                traced.close()  # exports the spans still batched
    return EXIT_OK


# How long a worker's stop may take beyond draining its step attempts: leaving the group,
# withdrawing its announcement and flushing the producer need the brokers.
STOP_GRACE_S = 20.0
# How long the stop of a worker Kafka refuses to log in may take.
LOCKED_OUT_STOP_S = 3.0


@contextlib.contextmanager
def _exit_if_stuck(seconds: float, *, why: str | None = None) -> Iterator[None]:
    """Exit the process if the block has not finished after ``seconds``: a stop that
    waits for brokers that are gone would otherwise wait for the producer's message
    timeout (minutes). Exiting then is what kill -9 does, which the engine is built to
    survive: the next owner restores from the topics, nothing acknowledged is lost.
    ``why``: the error the process stops for, printed as its last line."""

    def give_up() -> None:
        if why is not None:
            log.info(
                "exiting without leaving the group: the next owner of the partitions "
                "recovers from the topics"
            )
            logging.shutdown()
            print(f"error: {why}", file=sys.stderr, flush=True)
            os._exit(EXIT_ERROR)
        log.error(
            "stopping did not finish within %.0f s (are the Kafka brokers reachable?); "
            "exiting without it: the next owner of the partitions recovers from the topics",
            seconds,
        )
        logging.shutdown()
        os._exit(EXIT_ERROR)

    watchdog = threading.Timer(seconds, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


_HOST_HELP = "beyond loopback it needs --api-token or --insecure"
_TRACING_HELP = (
    " Traces: with OTEL_EXPORTER_OTLP_ENDPOINT (OTLP over HTTP) or "
    "OTEL_TRACES_EXPORTER=console set, it exports a span for each command it publishes, "
    "each activation of a run (the instance driven by an input: a start, an event, a "
    "timer, a step's outcome, a cancel, a pause) and each step attempt, after "
    "OpenTelemetry's messaging and exception conventions (docs/operations.md, Traces)."
)

COMMANDS = (
    Command(
        "dev",
        "serve the embedded engine, its HTTP API and the web UI (at /ui; it asks for the "
        "API token when one is set)",
        _dev,
        shared=(SERVING, CODEC, JSON),
        serves=True,
        epilog=_PROCESS_TUNING
        + _OBSERVED
        + " It prints one line once it listens (with --json, a JSON object: listening, "
        "data, partitions, processes, workflows). "
        "Example: stepstream dev --workflows examples.order --port 8233." + _TRACING_HELP,
        args=(
            arg(
                "--workflows",
                required=True,
                metavar="MODULES",
                help="comma-separated modules whose @workflow functions are served; the "
                "topics they declare as Source(...) are read from the Kafka cluster named by "
                "STEPSTREAM_SOURCES_BOOTSTRAP (HOST:PORT; prefix from STEPSTREAM_PREFIX); "
                "their ctx.publish(...) records are produced to the Kafka cluster named by "
                "STEPSTREAM_OUTBOX_BOOTSTRAP (HOST:PORT; without it a publish fails)",
            ),
            arg(
                "--data",
                metavar="DIR",
                help="data directory (default: $STEPSTREAM_DATA or ./.stepstream)",
            ),
            arg(
                "--host",
                default="127.0.0.1",
                help=f"address to listen on (%(default)s); {_HOST_HELP}",
            ),
            arg("--port", type=int, default=8233, help="port, 0 for any (%(default)s)"),
            arg(
                "--partitions",
                type=int,
                metavar="N",
                help="partitions of a new data directory (default: 4, or twice --processes)",
            ),
            arg(
                "--processes",
                type=int,
                default=1,
                metavar="N",
                help="engine processes sharing the partitions, to use N cores (default: 1). "
                "Each keeps its partitions in DATA/process-K and serves their API on a port "
                "of its own (GET /v1/processes lists them; the http:// client uses them); "
                "this process serves the API for all of them and starts the others again if "
                "they die. A data directory keeps the count it was made with",
            ),
            arg(
                "--hang-timeout",
                type=float,
                metavar="SECONDS",
                help="with --processes: kill an engine process that has not answered its "
                "health probe for this long and start it again, as a liveness probe would "
                "(default: 60; 0 leaves a hung process alone). Raise it if "
                "workflow code may block its event loop for longer",
            ),
        ),
    ),
    Command(
        "worker",
        "run workflows in a Kafka consumer group, and serve their reads and the web UI (at "
        "/ui, covering every worker's instances); on start it registers its workflows on "
        "<prefix>.definitions, so clients accept them from then on, even while no worker "
        "runs",
        _worker,
        shared=(KAFKA, SERVING, CODEC, JSON),
        serves=True,
        epilog="Workers with one --prefix form one consumer group and share its partitions. "
        "Rebalances are incremental: a worker joining, or leaving on SIGTERM, moves only "
        "the partitions that change hands (their running steps finish first, up to "
        "$STEPSTREAM_DRAIN_TIMEOUT_S); the others keep running. Workers of a stepstream "
        "version with eager rebalancing cannot share the group: stop them all first. A "
        "worker whose Kafka login is refused while it runs (its credential rotated or "
        "deleted on the brokers) logs why, answers 503 on /readyz and goes on by itself once "
        "Kafka accepts it again; $STEPSTREAM_EXIT_AFTER_LOGIN_REFUSED_S=S makes it exit 1 "
        "after S seconds instead, to be started again with the credentials it is given "
        "then (docs/kafka.md). "
        + _PROCESS_TUNING
        + _OBSERVED
        + " Example: stepstream worker --workflows pkg.flows --bootstrap kafka:9092."
        + _TRACING_HELP,
        args=(
            arg(
                "--workflows",
                required=True,
                metavar="MODULES",
                help="comma-separated modules whose @workflow functions are run; the topics "
                "they declare as Source(...) are read as event sources (consumer group "
                "PREFIX.sources; STEPSTREAM_SOURCES_COMMIT_INTERVAL_S); their "
                "ctx.publish(...) records are produced to this cluster, or to "
                "STEPSTREAM_OUTBOX_BOOTSTRAP (HOST:PORT) if set",
            ),
            arg(
                "--state-dir",
                metavar="DIR",
                help="local state, one RocksDB per owned partition (default: "
                "$STEPSTREAM_STATE_DIR or ./.stepstream-worker)",
            ),
            arg("--host", default="127.0.0.1", help=f"API address (%(default)s); {_HOST_HELP}"),
            arg("--port", type=int, default=8233, help="API port, 0 for any (%(default)s)"),
            arg(
                "--advertise",
                metavar="URL",
                help="the API's URL as clients reach it (default: http://HOST:PORT as bound, "
                "https with --tls-cert); its host is allowed in Host headers",
            ),
        ),
    ),
)
