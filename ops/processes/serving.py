"""Serving ``stepstream dev --processes N``: process 0 (the parent: the public API over
every process, the sources, the children) and each of the others (its partitions, its
internal API and its own partitions' public API)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from stepstream.consumers.embedded.errors import DataDirInUse
from stepstream.consumers.embedded.forwarding import ForwardReceiver
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.ops.api.security import ApiSecurity
from stepstream.ops.embedded import EmbeddedConfig, EmbeddedEngine, open_embedded
from stepstream.ops.processes.children import (
    HANG_TIMEOUT_S,
    Children,
    Spec,
    loopback_sockets,
    parent_gone,
    url_of,
    wait_ready,
)
from stepstream.ops.processes.forwarding import add_forward_routes, forwarding
from stepstream.ops.processes.layout import ProcessLayout, prepare_layout, process_dir
from stepstream.ops.processes.observability import ProcessesObservability
from stepstream.ops.processes.routing import (
    ProcessesTransport,
    add_processes_route,
    remote_transport,
)
from stepstream.ops.telemetry.metrics import Health, Observability, observability_for
from stepstream.producers.client import Transport

log = logging.getLogger("stepstream.processes")

OPEN_RETRY_S = 15.0  # a restarted child waits this long for its predecessor's lock


async def open_share(
    registry: Any,
    config: EmbeddedConfig,
    layout: ProcessLayout,
    process: int,
    codec: PayloadCodec | None = None,
) -> EmbeddedEngine:
    """Process ``process``'s engine: its own directory, its partitions. A child started
    again right after one that died may find the lock still held for a moment."""
    share = dataclasses.replace(
        config, data_dir=process_dir(config.data_dir, process), partitions=layout.partitions
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + OPEN_RETRY_S
    while True:
        try:
            return await open_embedded(registry, share, codec=codec, owned=layout.owns(process))
        except DataDirInUse:
            if loop.time() >= deadline:
                raise
            await asyncio.sleep(0.2)


async def serve_child(
    registry: Any,
    config: EmbeddedConfig,
    spec: Spec,
    public_app: Callable[[Transport, EmbeddedEngine, Observability], web.Application],
    tls: Any,
    *,
    codec: PayloadCodec | None = None,
) -> int:
    """A child: its partitions, their API on the sockets it was handed (the processes'
    one, behind their token; the clients' one, as the server's), forwarding; until
    SIGTERM, its parent is gone, or its data directory fails."""
    from stepstream.ops.api.serving import api_runner, cut_off, stop_on_signals
    from stepstream.ops.telemetry import tracing

    parent = os.getppid()
    layout = ProcessLayout(spec.processes, spec.partitions)
    sock = socket.socket(fileno=spec.fd)
    sock.setblocking(False)
    public = socket.socket(fileno=spec.public_fd)
    public.setblocking(False)
    engine = await open_share(registry, config, layout, spec.process, codec)
    traced = tracing.setup(engine.host, service="stepstream-dev")
    others = [g for g in range(spec.processes) if g != spec.process]
    remotes = {g: remote_transport(spec.urls[g], spec.token) for g in others}
    # One registry for both APIs: process 0 scrapes it through the internal one, and it
    # counts the requests of the clients' one.
    observability = _observability(engine)
    try:
        async with forwarding(engine, layout, spec.process, spec.urls, spec.token) as receiver:
            runner = web.AppRunner(
                internal_app(engine, config, spec.token, receiver, observability),
                handler_cancellation=True,
                access_log=None,  # the processes' own calls: the client's is logged once
            )
            await runner.setup()
            # Its own partitions straight, any other instance through its owner.
            everyone = ProcessesTransport(engine.transport, layout, spec.process, remotes)
            clients = api_runner(public_app(everyone, engine, observability))
            await clients.setup()
            try:
                await web.SockSite(runner, sock).start()
                await web.SockSite(clients, public, ssl_context=tls).start()
                log.info(
                    "engine process %d serving partitions %s",
                    spec.process,
                    layout.partitions_of(spec.process),
                )
                with stop_on_signals() as stop:
                    try:
                        await _until_stopped(engine, stop, parent_gone(parent))
                    except Exception:
                        await cut_off(clients)
                        raise
            finally:
                await clients.cleanup()
                await runner.cleanup()
    finally:
        for remote in remotes.values():
            await remote.close()
        sock.close()
        public.close()
        await engine.close()
        if traced is not None:
            traced.close()
    return 0


def internal_app(
    engine: EmbeddedEngine,
    config: EmbeddedConfig,
    token: str,
    receiver: ForwardReceiver,
    observability: Observability,
) -> web.Application:
    """A process's API for the other processes: its own partitions, forwarding, /metrics
    and /readyz, behind their token, on loopback. Its requests are not counted as HTTP
    requests: each is one that process 0 took from a client, and counted there."""
    from stepstream.ops.api.routes import DEFAULT_MAX_BODY_BYTES, make_app

    app = make_app(
        engine.transport,
        registry_names=engine.host.registry.names,
        max_body_bytes=max(DEFAULT_MAX_BODY_BYTES, 2 * config.max_payload_bytes),
        security=ApiSecurity(token=token),
        served_hosts=("127.0.0.1",),
        observability=dataclasses.replace(observability, http=None),
    )
    add_forward_routes(app, receiver)
    return app


def _observability(engine: EmbeddedEngine, **kwargs: Any) -> Observability:
    return observability_for(
        engine.host,
        Health(
            ready=lambda: engine.db.failure is None,
            reason=lambda: f"the data directory failed: {engine.db.failure}",
        ),
        **kwargs,
    )


async def _until_stopped(
    engine: EmbeddedEngine, stop: asyncio.Event, *more: Awaitable[Any]
) -> None:
    """Until ``stop`` is set or any of ``more`` ends; raises the data directory's failure
    if that is what ended it."""
    waits = [
        asyncio.ensure_future(stop.wait()),
        asyncio.ensure_future(engine.db.failed()),
        *(asyncio.ensure_future(m) for m in more),
    ]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
    failed = waits[1]
    if failed.done() and not failed.cancelled():
        raise failed.result()


async def serve_parent(
    registry: Any,
    config: EmbeddedConfig,
    processes: int,
    public: socket.socket,
    make_public_app: Callable[[Transport, EmbeddedEngine, Observability], web.Application],
    tls: Any,
    announce: Callable[[str, ProcessLayout], None],
    *,
    codec: PayloadCodec | None = None,
    hang_timeout: float = HANG_TIMEOUT_S,
) -> int:
    """Process 0: starts the others, runs its partitions, serves the public API over all
    of them on ``public``; until SIGTERM or its data directory fails."""
    from stepstream.ops.api.serving import address, api_runner, cut_off, listen, stop_on_signals
    from stepstream.ops.embedded_sources import start_embedded_sources
    from stepstream.ops.telemetry import tracing

    layout = prepare_layout(config.data_dir, processes, config.partitions)
    token = secrets.token_urlsafe(32)
    sockets = loopback_sockets(processes)
    urls = [url_of(s) for s in sockets]
    # The other processes' public APIs: the same host as this one's, ports of their own.
    host = public.getsockname()[0]
    publics = [public] + [listen(host, 0) for _ in range(1, processes)]
    ports = [s.getsockname()[1] for s in publics]
    specs = [
        Spec(g, processes, layout.partitions, urls, token, sockets[g].fileno(), publics[g].fileno())
        for g in range(1, processes)
    ]
    children = Children(specs, hang_timeout)
    children.start()
    engine: EmbeddedEngine | None = None
    traced = None
    internal: web.AppRunner | None = None
    remotes = {g: remote_transport(urls[g], token) for g in range(1, processes)}
    stack = contextlib.AsyncExitStack()
    try:
        engine = await open_share(registry, config, layout, 0, codec)
        traced = tracing.setup(engine.host, service="stepstream-dev")
        sources = await start_embedded_sources(registry, engine)
        if sources is not None:
            stack.push_async_callback(sources.stop)
        base = _observability(
            engine, source_lag=sources.lag.records if sources is not None else dict
        )
        async with forwarding(engine, layout, 0, urls, token) as receiver:
            internal = web.AppRunner(
                internal_app(engine, config, token, receiver, base), access_log=None
            )
            await internal.setup()
            await web.SockSite(internal, sockets[0]).start()
            await wait_ready(urls, token, children)
            transport = ProcessesTransport(engine.transport, layout, 0, remotes)
            observability = ProcessesObservability(
                base.registry,
                base.health,
                base.http,
                base.engine,
                peers=urls[1:],
                token=token,
                restarts=lambda: children.restarts,
                hangs=lambda: children.hangs,
            )
            app = make_public_app(transport, engine, observability)
            add_processes_route(app, layout, ports)
            runner = api_runner(app)
            await runner.setup()
            with stop_on_signals() as stop:
                try:
                    await web.SockSite(runner, public, ssl_context=tls).start()
                    announce(address(public), layout)
                    try:
                        await _until_stopped(engine, stop)
                    except Exception:
                        await cut_off(runner)
                        raise
                    log.info("shutting down")
                finally:
                    await runner.cleanup()
    finally:
        await stack.aclose()  # the sources
        for remote in remotes.values():
            await remote.close()
        await children.stop()
        if internal is not None:
            await internal.cleanup()
        for sock in [*sockets, *publics[1:]]:
            sock.close()
        if engine is not None:
            await engine.close()
        if traced is not None:
            traced.close()
    return 0
