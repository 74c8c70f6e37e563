"""What the serving commands run (their table is ``serve``): ``stepstream dev`` (the
embedded engine, its API and web UI in one process, or in N) and ``stepstream worker``
(a member of a Kafka consumer group). Imported only when one of them runs: the HTTP
server, metrics and tracing it needs are no cost to every other command."""

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
from stepstream.engine.config.environ import ConfigError
from stepstream.engine.errors import StepstreamError
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.ops import event_loop
from stepstream.ops.api.limits import ApiLimits
from stepstream.ops.api.routes import DEFAULT_MAX_BODY_BYTES, make_app
from stepstream.ops.api.security import ApiSecurity, InsecureBind
from stepstream.ops.api.serving import address, api_runner, cut_off, reachable
from stepstream.ops.api.serving import listen as _listen
from stepstream.ops.api.serving import stop_on_signals as _stop_on_signals
from stepstream.ops.cli import render
from stepstream.ops.cli.options import (
    codec_from_args,
    kafka_settings,
)
from stepstream.ops.cli.options import put_cwd_on_path as _put_cwd_on_path
from stepstream.ops.cli.table import EXIT_ERROR, EXIT_OK, UsageError
from stepstream.ops.gc_tuning import WORKER_THRESHOLDS, tune_for_serving
from stepstream.ops.telemetry import tracing
from stepstream.ops.telemetry.metrics import Health, observability_for

log = logging.getLogger("stepstream.cli")


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


def _api_security(args: argparse.Namespace) -> ApiSecurity:
    """The API's access settings from the server flags and STEPSTREAM_* variables;
    refused (exit 2) when they would open the API to anyone."""
    security = ApiSecurity.from_env(
        token=args.api_token,
        insecure=True if args.insecure else None,
        allowed_hosts=args.allowed_host,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        public_urls=args.public_url,
    )
    try:
        security.check_bind(args.host)
    except InsecureBind as exc:
        raise UsageError(str(exc)) from None
    return security


def _api_limits(args: argparse.Namespace) -> ApiLimits:
    """What the API holds at once (--max-pending, STEPSTREAM_MAX_PENDING)."""
    try:
        return ApiLimits.from_env(max_pending=args.max_pending)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


# ---- dev ------------------------------------------------------------------------------


def run_dev(args: argparse.Namespace) -> int:
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
    security = _api_security(args)
    limits = _api_limits(args)
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
    limits = _api_limits(args)

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


def run_worker(args: argparse.Namespace) -> int:
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
        api=_api_security(args),
        api_limits=_api_limits(args),
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
