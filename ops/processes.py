"""``stepstream dev --processes N``: the embedded engine's partitions spread over N
processes, so one machine's engine uses N cores.

Layout: ``DATA/processes.json`` says how many processes and partitions the directory was
made for; ``DATA/process-G/`` is process G's own data directory (its RocksDB, its lock,
its fencing epoch). Process G owns the partitions ``p`` with ``p % N == G``.

The ``stepstream dev`` process is process 0: it runs its partitions, the public API (web
UI, ``/metrics``, ``/readyz``) and the sources, and starts processes 1..N-1 as children.
Each child serves the API of its own partitions on a loopback socket the parent opened
and handed it (so its address outlives a restart of the child), behind a token only the
processes know. The public API sends each call about an instance to the process that
owns it, over that process's API session, and merges listings and overviews. Commands
one process's instances send to another's (a child's start, a message, a parent's
notice) are forwarded through the log, exactly once (``consumers/embedded/forwarding``).
A child that dies is started again; a child whose parent is gone stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from stepstream.consumers.embedded.errors import DataDirInUse
from stepstream.consumers.embedded.forwarding import (
    Entries,
    Forwarder,
    ForwardReceiver,
    decode_batch,
    encode_batch,
)
from stepstream.engine.errors import StepstreamError
from stepstream.engine.reads.listing import (
    InstancePage,
    ListQuery,
    Overview,
    merge_overviews,
    merge_pages,
)
from stepstream.engine.reads.views import HistoryEntry, InstanceStatus
from stepstream.engine.wire.topics import partition_for
from stepstream.ops.api.security import INTERNAL_PREFIX, RECORDS_TYPE, ApiSecurity
from stepstream.ops.embedded import PROCESSES_FILE, EmbeddedConfig, EmbeddedEngine, open_embedded
from stepstream.ops.telemetry.metrics import CONTENT_TYPE, Health, Observability, observability_for
from stepstream.producers.client import Transport
from stepstream.producers.http.security import client_headers
from stepstream.producers.http.transport import HttpTransport
from stepstream.producers.http.wire import PROCESSES_PATH

log = logging.getLogger("stepstream.processes")

LAYOUT_FILE = PROCESSES_FILE
SPEC_ENV = "STEPSTREAM_PROCESS_SPEC"  # set for a child: which process it is, and its peers
PARENT_POLL_S = 0.5  # how often a child looks whether its parent is still there
READY_TIMEOUT_S = 120.0  # the longest the parent waits for a child to restore and serve
RESTART_DELAY_S = 1.0
OPEN_RETRY_S = 15.0  # a restarted child waits this long for its predecessor's lock
STOP_TIMEOUT_S = 60.0
T = TypeVar("T")


@dataclass(frozen=True)
class ProcessLayout:
    """How partitions are spread over the engine processes."""

    processes: int
    partitions: int

    def owner(self, partition: int) -> int:
        return partition % self.processes

    def process_of(self, instance_id: str) -> int:
        return self.owner(partition_for(instance_id, self.partitions))

    def partitions_of(self, process: int) -> list[int]:
        return [p for p in range(self.partitions) if self.owner(p) == process]

    def others(self, process: int) -> list[int]:
        """The partitions other processes own: this process forwards to them."""
        return [p for p in range(self.partitions) if self.owner(p) != process]

    def owns(self, process: int) -> Callable[[int], bool]:
        return lambda partition: self.owner(partition) == process


def process_dir(data_dir: str, process: int) -> str:
    return os.path.join(data_dir, f"process-{process}")


def is_split(data_dir: str) -> bool:
    """Whether ``data_dir`` holds the partitions of several engine processes."""
    return os.path.exists(os.path.join(data_dir, LAYOUT_FILE))


def prepare_layout(data_dir: str, processes: int, partitions: int | None) -> ProcessLayout:
    """The layout of ``data_dir`` for ``processes`` processes: made if the directory is
    new, checked against what it was made with otherwise (partitions cannot move between
    processes' directories, so the counts cannot change)."""
    path = os.path.join(data_dir, LAYOUT_FILE)
    try:
        with open(path) as f:
            stored = json.load(f)
        layout = ProcessLayout(int(stored["processes"]), int(stored["partitions"]))
    except FileNotFoundError:
        if os.path.isdir(data_dir) and os.listdir(data_dir):
            raise StepstreamError(
                f"data directory {data_dir} was written by one engine process: run it without "
                "--processes (or with --processes 1), or give --processes another --data"
            ) from None
        count = partitions if partitions is not None else max(4, 2 * processes)
        if count < processes:
            raise StepstreamError(
                f"--partitions {count} cannot be spread over {processes} processes: pass "
                f"--partitions {processes} or more"
            ) from None
        layout = ProcessLayout(processes, count)
        os.makedirs(data_dir, exist_ok=True)
        temporary = path + ".tmp"
        with open(temporary, "w") as f:
            json.dump(dataclasses.asdict(layout), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        return layout
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StepstreamError(
            f"cannot read {path}: {exc}; is it a stepstream data directory?"
        ) from None
    if layout.processes != processes:
        raise StepstreamError(
            f"data directory {data_dir} holds partitions spread over {layout.processes} "
            f"processes: pass --processes {layout.processes}, or another --data"
        )
    if partitions is not None and partitions != layout.partitions:
        raise StepstreamError(
            f"data directory {data_dir} was created with {layout.partitions} partitions: pass "
            f"--partitions {layout.partitions}, or another --data"
        )
    return layout


# ---- the public API over every process -------------------------------------------------


class ProcessesTransport:
    """The API's transport in process 0: each call about an instance goes to the process
    that owns it (this one's own transport, or another's API session); listings and
    overviews are merged from all of them."""

    def __init__(
        self, local: Transport, layout: ProcessLayout, me: int, remotes: Mapping[int, Transport]
    ) -> None:
        self._layout = layout
        self._all: dict[int, Transport] = {me: local, **remotes}

    def _to(self, instance_id: str) -> Transport:
        return self._all[self._layout.process_of(instance_id)]

    async def start(
        self, workflow: str, input: Any, instance_id: str, version: str | None = None
    ) -> str:
        return await self._to(instance_id).start(workflow, input, instance_id, version)

    async def send_event(
        self, instance_id: str, name: str, payload: Any, event_id: str | None = None
    ) -> None:
        await self._to(instance_id).send_event(instance_id, name, payload, event_id)

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        return await self._to(instance_id).reply(instance_id, message_id, timeout)

    async def cancel(self, instance_id: str, reason: str) -> None:
        await self._to(instance_id).cancel(instance_id, reason)

    async def pause(self, instance_id: str) -> None:
        await self._to(instance_id).pause(instance_id)

    async def resume(self, instance_id: str) -> None:
        await self._to(instance_id).resume(instance_id)

    async def status(self, instance_id: str) -> InstanceStatus:
        return await self._to(instance_id).status(instance_id)

    async def result(self, instance_id: str, timeout: float | None) -> Any:
        return await self._to(instance_id).result(instance_id, timeout)

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        return await self._to(instance_id).history(instance_id)

    async def list(self, status: str | None) -> list[InstanceStatus]:
        answers = await self._every(lambda t: t.list(status))
        merged = [view for answer in answers for view in answer]
        return sorted(merged, key=lambda v: (v.created_at, v.instance_id))

    async def list_page(self, query: ListQuery) -> InstancePage:
        return merge_pages(await self._every(lambda t: t.list_page(query)), query.limit)

    async def overview(self) -> Overview:
        return merge_overviews(await self._every(lambda t: t.overview()))

    async def _every(self, call: Callable[[Transport], Awaitable[T]]) -> Sequence[T]:
        return await asyncio.gather(*(call(t) for t in self._all.values()))

    async def close(self) -> None:
        for transport in self._all.values():
            await transport.close()


def remote_transport(url: str, token: str) -> HttpTransport:
    """Another process's API, as its ``http://`` client sees it."""
    session = aiohttp.ClientSession(
        headers=client_headers(token), connector=aiohttp.TCPConnector(limit=64)
    )
    return HttpTransport(url, session)


def add_processes_route(app: web.Application, layout: ProcessLayout, ports: Sequence[int]) -> None:
    """``GET /v1/processes``: where each process serves its own partitions' API, so a
    client can send each instance's calls straight to its owner
    (``producers/http/routing.py``)."""
    answer = {
        "partitions": layout.partitions,
        "processes": [{"process": g, "port": port} for g, port in enumerate(ports)],
    }

    async def processes(request: web.Request) -> web.Response:
        return web.json_response(answer)

    app.router.add_get(PROCESSES_PATH, processes)


# ---- forwarding between processes ------------------------------------------------------

FORWARD_PATH = INTERNAL_PREFIX + "v1/forward"


def add_forward_routes(app: web.Application, receiver: ForwardReceiver) -> None:
    """The owner's side of forwarding, on an app whose guard checks the processes' token."""

    async def position(request: web.Request) -> web.Response:
        try:
            source = int(request.query["source"])
            partition = int(request.query["partition"])
            return web.json_response({"next": receiver.position(source, partition)})
        except (KeyError, ValueError) as exc:
            return web.json_response(
                {"error": f"bad forwarding position request: {exc}"}, status=400
            )

    async def receive(request: web.Request) -> web.Response:
        try:
            source, partition, first, entries = decode_batch(await request.read())
            following = await receiver.receive(source, partition, first, entries)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        return web.json_response({"next": following})

    app.router.add_get(FORWARD_PATH, position)
    app.router.add_post(FORWARD_PATH, receive)


class ForwardClient:
    """The source's side of forwarding: asks the owners over HTTP."""

    def __init__(self, me: int, layout: ProcessLayout, urls: Sequence[str], token: str) -> None:
        self._me = me
        self._layout = layout
        self._urls = urls
        self._http = aiohttp.ClientSession(
            headers=client_headers(token), timeout=aiohttp.ClientTimeout(total=30)
        )

    def _url(self, partition: int) -> str:
        return self._urls[self._layout.owner(partition)] + FORWARD_PATH

    async def position(self, partition: int) -> int:
        params = {"source": str(self._me), "partition": str(partition)}
        async with self._http.get(self._url(partition), params=params) as response:
            return await _next_offset(response)

    async def send(self, partition: int, first: int, entries: Entries) -> int:
        body = encode_batch(self._me, partition, first, entries)
        headers = {"Content-Type": RECORDS_TYPE}
        async with self._http.post(self._url(partition), data=body, headers=headers) as response:
            return await _next_offset(response)

    async def close(self) -> None:
        await self._http.close()


async def _next_offset(response: aiohttp.ClientResponse) -> int:
    answer = await response.json(content_type=None)
    if response.status != 200:
        raise StepstreamError(f"HTTP {response.status}: {answer.get('error', answer)}")
    return int(answer["next"])


# ---- metrics and readiness over every process ------------------------------------------


@dataclass(frozen=True)
class ProcessesObservability(Observability):
    """``/metrics`` with every process's series, labelled ``process``; ``/readyz`` ready
    when every process is."""

    peers: Sequence[str] = ()  # the other processes' API URLs, process 1 first
    token: str = ""
    restarts: Callable[[], Mapping[int, int]] = dict  # process -> times started again

    async def metrics(self, request: web.Request) -> web.Response:
        texts = [generate_latest(self.registry).decode()]
        async with aiohttp.ClientSession(headers=client_headers(self.token)) as http:
            for url in self.peers:
                try:
                    async with http.get(url + "/metrics") as response:
                        texts.append(await response.text())
                except aiohttp.ClientError:
                    texts.append("")  # a process starting again: its series come back with it
        restarts = Metric(
            "stepstream_engine_process_restarts",
            "Times an engine process of `stepstream dev --processes` died and was started "
            "again, by process.",
            "counter",
        )
        for process in range(1, len(self.peers) + 1):
            count = self.restarts().get(process, 0)
            restarts.add_sample(
                "stepstream_engine_process_restarts_total", {"process": str(process)}, count
            )
        body = generate_latest(_labelled(texts, restarts))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def readyz(self, request: web.Request) -> web.Response:
        if not self.health.ready():
            return web.json_response({"ready": False, "reason": self.health.reason()}, status=503)
        async with aiohttp.ClientSession(headers=client_headers(self.token)) as http:
            for index, url in enumerate(self.peers, start=1):
                reason = await _not_ready(http, url)
                if reason:
                    return web.json_response(
                        {"ready": False, "reason": f"engine process {index}: {reason}"},
                        status=503,
                    )
        return web.json_response({"ready": True})


async def _not_ready(http: aiohttp.ClientSession, url: str) -> str:
    try:
        async with http.get(url + "/readyz") as response:
            if response.status == 200:
                return ""
            answer = await response.json(content_type=None)
            return str(answer.get("reason", f"HTTP {response.status}"))
    except aiohttp.ClientError as exc:
        return f"not answering ({exc}); it is being started again"


class _Merged:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _labelled(texts: Sequence[str], *more: Metric) -> CollectorRegistry:
    """One registry of every process's families, each sample labelled with its process,
    and ``more``."""
    merged: dict[str, Metric] = {m.name: m for m in more}
    for process, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type)
            into.samples += [
                Sample(s.name, {**s.labels, "process": str(process)}, s.value, s.timestamp)
                for s in family.samples
            ]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return registry


# ---- the processes' shared pieces ------------------------------------------------------


@dataclass
class Spec:
    """What a child is told: which process it is and how to reach the others."""

    process: int
    processes: int
    partitions: int
    urls: list[str]  # every process's internal API URL, by process
    token: str
    fd: int  # the listening socket the parent opened for this child's internal API
    public_fd: int  # and the one for its own partitions' public API

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls, text: str) -> Spec:
        return cls(**json.loads(text))


async def open_share(
    registry: Any, config: EmbeddedConfig, layout: ProcessLayout, process: int
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
            return await open_embedded(registry, share, owned=layout.owns(process))
        except DataDirInUse:
            if loop.time() >= deadline:
                raise
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def forwarding(
    engine: EmbeddedEngine, layout: ProcessLayout, me: int, urls: Sequence[str], token: str
) -> AsyncIterator[ForwardReceiver]:
    """The receiver of this process's partitions and the forwarder of the others'."""
    receiver = ForwardReceiver(engine.db, layout.partitions_of(me))
    client = ForwardClient(me, layout, urls, token)
    forwarder = Forwarder(engine.db, layout.others(me), client.send, client.position)
    forwarder.start()
    try:
        yield receiver
    finally:
        await forwarder.close()
        await client.close()


# ---- the children ----------------------------------------------------------------------


class Children:
    """Processes 1..N-1: started, started again when one dies, stopped at the end."""

    def __init__(self, specs: Sequence[Spec]) -> None:
        self._specs = specs
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.restarts: dict[int, int] = {}  # process -> times started again
        self.exits: dict[int, int] = {}  # process -> the status it last exited with

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._keep(spec)) for spec in self._specs]

    async def _keep(self, spec: Spec) -> None:
        while not self._stopping:
            env = {**os.environ, SPEC_ENV: spec.to_env()}
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "stepstream.ops.cli",
                *sys.argv[1:],
                env=env,
                pass_fds=(spec.fd, spec.public_fd),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                # Out of the terminal's process group: Ctrl-C stops the server, which
                # stops its children, rather than racing it to them (and a restart).
                start_new_session=True,
            )
            self._procs[spec.process] = proc
            code = await proc.wait()
            if self._stopping:
                return
            self.restarts[spec.process] = self.restarts.get(spec.process, 0) + 1
            self.exits[spec.process] = code
            log.error(
                "engine process %d (pid %d) exited with status %d; starting it again (its "
                "partitions wait until it is back, nothing is lost)",
                spec.process,
                proc.pid,
                code,
            )
            await asyncio.sleep(RESTART_DELAY_S)

    async def stop(self) -> None:
        self._stopping = True
        for proc in self._procs.values():
            if proc.returncode is None:
                proc.terminate()
        for process, proc in self._procs.items():
            try:
                await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning(
                    "engine process %d did not stop in %.0f s; killing it", process, STOP_TIMEOUT_S
                )
                proc.kill()
                await proc.wait()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def wait_ready(urls: Sequence[str], token: str, children: Children) -> None:
    """Until every child's ``/readyz`` says ready; says which one did not, and why."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    async with aiohttp.ClientSession(headers=client_headers(token)) as http:
        for process, url in enumerate(urls[1:], start=1):
            reason = "not started"
            while loop.time() < deadline:
                reason = await _not_ready(http, url)
                if not reason:
                    break
                await asyncio.sleep(0.1)
            else:
                exited = children.exits.get(process)
                said = "" if exited is None else f", and it exited with status {exited}"
                raise StepstreamError(
                    f"engine process {process} was not ready in {READY_TIMEOUT_S:.0f} s "
                    f"({reason}{said}); its log lines above say why"
                )


def loopback_sockets(count: int) -> list[socket.socket]:
    """Listening loopback sockets, one for each process's internal API."""
    from stepstream.ops.api.serving import listen

    return [listen("127.0.0.1", 0) for _ in range(count)]


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


async def parent_gone(parent: int) -> None:
    """Returns once the process that started this one is gone (killed with -9, say)."""
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)


# ---- serving: process 0 (the parent) and the others ------------------------------------


async def serve_child(
    registry: Any,
    config: EmbeddedConfig,
    spec: Spec,
    public_app: Callable[[Transport, EmbeddedEngine, Observability], web.Application],
    tls: Any,
) -> int:
    """A child: its partitions, their API on the sockets it was handed (the processes'
    one, behind their token; the clients' one, as the server's), forwarding; until
    SIGTERM, its parent is gone, or its data directory fails."""
    from stepstream.ops.api.serving import api_runner, stop_on_signals
    from stepstream.ops.telemetry import tracing

    parent = os.getppid()
    layout = ProcessLayout(spec.processes, spec.partitions)
    sock = socket.socket(fileno=spec.fd)
    sock.setblocking(False)
    public = socket.socket(fileno=spec.public_fd)
    public.setblocking(False)
    engine = await open_share(registry, config, layout, spec.process)
    traced = tracing.setup(engine.host, service="stepstream-dev")
    others = [g for g in range(spec.processes) if g != spec.process]
    remotes = {g: remote_transport(spec.urls[g], spec.token) for g in others}
    try:
        async with forwarding(engine, layout, spec.process, spec.urls, spec.token) as receiver:
            runner = web.AppRunner(
                internal_app(engine, config, spec.token, receiver), handler_cancellation=True
            )
            await runner.setup()
            # Its own partitions straight, any other instance through its owner.
            everyone = ProcessesTransport(engine.transport, layout, spec.process, remotes)
            clients = api_runner(public_app(everyone, engine, _observability(engine)))
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
                    await _until_stopped(engine, stop, parent_gone(parent))
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
    engine: EmbeddedEngine, config: EmbeddedConfig, token: str, receiver: ForwardReceiver
) -> web.Application:
    """A process's API for the other processes: its own partitions, forwarding, /metrics
    and /readyz, behind their token, on loopback."""
    from stepstream.ops.api.routes import DEFAULT_MAX_BODY_BYTES, make_app

    app = make_app(
        engine.transport,
        registry_names=engine.host.registry.names,
        max_body_bytes=max(DEFAULT_MAX_BODY_BYTES, 2 * config.max_payload_bytes),
        security=ApiSecurity(token=token),
        served_hosts=("127.0.0.1",),
        observability=_observability(engine),
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
) -> int:
    """Process 0: starts the others, runs its partitions, serves the public API over all
    of them on ``public``; until SIGTERM or its data directory fails."""
    from stepstream.ops.api.serving import address, api_runner, listen, stop_on_signals
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
    children = Children(specs)
    children.start()
    engine: EmbeddedEngine | None = None
    traced = None
    internal: web.AppRunner | None = None
    remotes = {g: remote_transport(urls[g], token) for g in range(1, processes)}
    stack = contextlib.AsyncExitStack()
    try:
        engine = await open_share(registry, config, layout, 0)
        traced = tracing.setup(engine.host, service="stepstream-dev")
        sources = await start_embedded_sources(registry, engine)
        if sources is not None:
            stack.push_async_callback(sources.stop)
        async with forwarding(engine, layout, 0, urls, token) as receiver:
            internal = web.AppRunner(internal_app(engine, config, token, receiver))
            await internal.setup()
            await web.SockSite(internal, sockets[0]).start()
            await wait_ready(urls, token, children)
            transport = ProcessesTransport(engine.transport, layout, 0, remotes)
            base = _observability(
                engine, source_lag=sources.lag.records if sources is not None else dict
            )
            observability = ProcessesObservability(
                base.registry,
                base.health,
                peers=urls[1:],
                token=token,
                restarts=lambda: children.restarts,
            )
            app = make_public_app(transport, engine, observability)
            add_processes_route(app, layout, ports)
            runner = api_runner(app)
            await runner.setup()
            with stop_on_signals() as stop:
                try:
                    await web.SockSite(runner, public, ssl_context=tls).start()
                    announce(address(public), layout)
                    await _until_stopped(engine, stop)
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
