"""The http:// client's commands travel as calls on its ``/v1/session`` websocket, many to
a frame, with the same answers and errors as the HTTP routes; a big one goes as a request
of its own. Through the public client against the real API over an embedded engine."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from stepstream.engine.errors import (
    InstanceFinished,
    InstanceNotPaused,
    InvalidPayload,
    UnknownInstance,
    UnknownWorkflow,
    WorkflowCancelled,
)
from stepstream.ops.api.routes import make_app
from stepstream.ops.embedded import EmbeddedConfig, EmbeddedEngine, open_embedded
from stepstream.producers.client import Client
from stepstream.producers.http.wire import SESSION_COMMAND_BYTES
from tests import conftest


@asynccontextmanager
async def serving(tmp_path: Path, *, websockets: bool) -> AsyncIterator[tuple[str, list[str]]]:
    """The API's URL, and the paths of the POST requests it served; without websockets
    its session upgrade is refused as by a proxy that does not pass them."""
    async with serving_engine(tmp_path, websockets=websockets) as (url, posts, _):
        yield url, posts


@asynccontextmanager
async def serving_engine(
    tmp_path: Path, *, websockets: bool, processes_ports: list[int] | None = None
) -> AsyncIterator[tuple[str, list[str], EmbeddedEngine]]:
    """``serving``, and the engine behind the API; with ``processes_ports`` the API also
    says, as ``stepstream dev --processes`` does, that other processes serve on them."""
    engine = await open_embedded(
        conftest.test_registry(), EmbeddedConfig(data_dir=str(tmp_path / "data"), partitions=2)
    )
    posts: list[str] = []

    @web.middleware
    async def count(request: web.Request, handler: web.RequestHandler) -> web.StreamResponse:
        if request.method == "POST":
            posts.append(request.path)
        if not websockets and request.path == "/v1/session":
            raise web.HTTPBadGateway()
        return await handler(request)

    app = make_app(engine.transport)
    app.middlewares.append(count)
    if processes_ports is not None:
        ports = processes_ports

        async def processes(request: web.Request) -> web.Response:
            listed = [{"process": g, "port": p} for g, p in enumerate([port, *ports])]
            return web.json_response({"partitions": 2, "processes": listed})

        app.router.add_get("/v1/processes", processes)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", posts, engine
    finally:
        await runner.cleanup()
        await engine.close()


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    async with serving(tmp_path, websockets=True) as served:
        yield served


async def test_commands_go_on_the_session_with_the_routes_answers(
    api: tuple[str, list[str]],
) -> None:
    url, posts = api
    async with Client.connect(url) as client:
        # 200 starts at once share frames; each gets its own answer.
        ids = await asyncio.gather(
            *(client.start("arith", n, instance_id=f"a-{n}") for n in range(200))
        )
        assert ids == [f"a-{n}" for n in range(200)]
        assert await client.result("a-7", timeout=30) == {"total": 8, "doubled": 16}
        generated = await client.start("arith", 1)  # the server names it
        assert await client.result(generated, timeout=30) == {"total": 2, "doubled": 4}

        waiting = await client.start("waiter", None, instance_id="w-1")
        with pytest.raises(InstanceNotPaused):
            await client.resume(waiting)
        await client.pause(waiting)
        await client.send_event(waiting, "approval", {"ok": True}, event_id="e-1")
        await client.send_event(waiting, "approval", {"ok": True}, event_id="e-1")  # once
        await client.resume(waiting)
        assert await client.result(waiting, timeout=30) == {"ok": True}

        doomed = await client.start("waiter", None, instance_id="w-2")
        await client.cancel(doomed, reason="not needed")
        with pytest.raises(WorkflowCancelled, match="not needed"):
            await client.result(doomed, timeout=30)
        with pytest.raises(InstanceFinished):
            await client.send_event(doomed, "approval", 1)

        # Errors come back as the same classes, and the session goes on serving.
        with pytest.raises(UnknownWorkflow, match="no-such"):
            await client.start("no-such", 1)
        with pytest.raises(UnknownInstance):
            await client.pause("nobody")
        with pytest.raises(InvalidPayload):
            await client.send_event("w-1", "", 1)
        assert await client.start("arith", 2, instance_id="after-errors") == "after-errors"
    assert posts == []  # not one request for all of those commands


async def test_a_big_command_goes_as_a_request_of_its_own(api: tuple[str, list[str]]) -> None:
    url, posts = api
    big = "x" * (SESSION_COMMAND_BYTES + 1)
    async with Client.connect(url) as client:
        waiting = await client.start("waiter", None, instance_id="w-big")
        await client.send_event(waiting, "approval", big)
        assert await client.result(waiting, timeout=30) == big
    assert posts == ["/v1/instances/w-big/events"]


async def test_session_commands_are_checked_as_the_routes_check_them(
    api: tuple[str, list[str]],
) -> None:
    url, _ = api
    calls = [
        {"id": 1, "op": "start", "workflow": "waiter", "instance_id": "v-1"},
        {"id": 2, "op": "send_event", "instance_id": "v-1", "name": "approval", "evnt_id": "x"},
        {"id": 3, "op": "cancel_workflow", "instance_id": "v-1", "reason": None},
        {"id": 4, "op": "pause"},
        {"id": 5, "op": "start", "workflow": 7},
    ]
    async with aiohttp.ClientSession() as http, http.ws_connect(url + "/v1/session") as ws:
        await ws.send_json(calls)
        replies: dict[int, dict[str, object]] = {}
        while len(replies) < len(calls):
            for reply in await ws.receive_json(timeout=10):
                replies[reply["id"]] = reply
    assert replies[1]["ok"] == {"instance_id": "v-1"}
    problems = {n: str(replies[n].get("error")) for n in (2, 3, 4, 5)}
    assert "unknown evnt_id" in problems[2] and "event_id" in problems[2]  # a typo is caught
    assert "'reason' must be a string" in problems[3]
    assert "missing instance_id" in problems[4]
    assert "'workflow' must be a non-empty string" in problems[5]


async def test_without_websockets_commands_go_as_requests(tmp_path: Path) -> None:
    """A proxy that does not pass websockets (or an older server) costs the commands
    nothing but their batching."""
    async with serving(tmp_path, websockets=False) as (url, posts):
        async with Client.connect(url) as client:
            await client.start("waiter", None, instance_id="p-1")
            await client.send_event("p-1", "approval", 1)
            await client.start("waiter", None, instance_id="p-2")
            assert (await client.status("p-1")).status == "completed"
    assert posts == ["/v1/instances", "/v1/instances/p-1/events", "/v1/instances"]


async def test_a_session_command_without_trace_fields_does_not_join_the_upgrades_trace(
    tmp_path: Path,
) -> None:
    """A websocket opened inside some trace (an instrumented HTTP client puts
    ``traceparent`` on the upgrade request) must not make that trace the parent of every
    command sent on it later: a command with no trace fields is in no trace, as a POST
    without the header is; one with its own fields joins its own."""
    stale = "00-11111111111111111111111111111111-2222222222222222-01"
    own = "00-33333333333333333333333333333333-4444444444444444-01"
    calls = [
        {"id": 1, "op": "start", "workflow": "waiter", "instance_id": "t-none"},
        {"id": 2, "op": "start", "workflow": "waiter", "instance_id": "t-own", "traceparent": own},
    ]
    async with (
        serving_engine(tmp_path, websockets=True) as (url, _, engine),
        aiohttp.ClientSession() as http,
    ):
        async with http.ws_connect(url + "/v1/session", headers={"traceparent": stale}) as ws:
            await ws.send_json(calls)
            replies: dict[int, dict[str, object]] = {}
            while len(replies) < len(calls):
                for reply in await ws.receive_json(timeout=10):
                    replies[reply["id"]] = reply
        assert all("ok" in reply for reply in replies.values()), replies
        # The journal: each started record carries its command's trace context.
        none, own_run = (engine.host.read_history(i)[0] for i in ("t-none", "t-own"))
    assert none.type == own_run.type == "WorkflowStarted"
    assert none.traceparent is None or "1111111111" not in none.traceparent
    assert own_run.traceparent is not None and "3333333333" in own_run.traceparent


async def test_records_state_the_runs_trace_once_and_another_trace_where_it_caused_them(
    tmp_path: Path,
) -> None:
    """The journal names a run's trace on WorkflowStarted only; the records an event sent
    from another trace caused carry that trace, so a Kafka tool can follow either."""
    run = "00-55555555555555555555555555555555-6666666666666666-01"
    other = "00-77777777777777777777777777777777-8888888888888888-01"
    start = {"id": 1, "op": "start", "workflow": "waiter", "instance_id": "tr-1"}
    send = {"id": 2, "op": "send_event", "instance_id": "tr-1", "name": "approval"}
    async with (
        serving_engine(tmp_path, websockets=True) as (url, _, engine),
        aiohttp.ClientSession() as http,
        http.ws_connect(url + "/v1/session") as ws,
    ):
        for call in ({**start, "traceparent": run}, {**send, "traceparent": other}):
            await ws.send_json([call])
            (reply,) = await ws.receive_json(timeout=10)
            assert "ok" in reply, reply
        async with Client.connect(url) as client:
            assert await client.result("tr-1", timeout=10) is None
        history = engine.host.read_history("tr-1")
        recorded_run = engine.host.read_state("tr-1").traceparent
    # By trace id: a process with a tracer provider (another test may have set the global
    # one) records its producer span, a child in the same trace, as the parent.
    traces = [(r.type, _trace_id(r.traceparent)) for r in history]
    assert traces[0] == ("WorkflowStarted", _trace_id(run))
    assert ("WaitStarted", None) in traces  # caused by the start: the run's own trace
    after_event = traces[[t for t, _ in traces].index("WaitStarted") + 1 :]
    assert after_event and all(tp == _trace_id(other) for _, tp in after_event), traces
    assert _trace_id(recorded_run) == _trace_id(run)  # the run's spans still join it


def _trace_id(traceparent: str | None) -> str | None:
    return None if traceparent is None else traceparent.split("-")[1]


async def test_when_the_processes_ports_cannot_be_reached_calls_go_through_the_server(
    tmp_path: Path,
) -> None:
    """A server of several processes whose own ports a firewall hides: the client finds
    it cannot reach them and sends every call to the server, which passes it on."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        unreachable = [closed.getsockname()[1]]
        async with (
            serving_engine(tmp_path, websockets=True, processes_ports=unreachable) as (
                url,
                _,
                _engine,
            ),
            Client.connect(url) as client,
        ):
            for i in range(4):  # on either "process"
                await client.start("waiter", None, instance_id=f"fw-{i}")
                await client.send_event(f"fw-{i}", "approval", i)
            assert [await client.result(f"fw-{i}", timeout=10) for i in range(4)] == [0, 1, 2, 3]
    finally:
        closed.close()


async def test_an_unknown_path_is_told_what_the_server_serves(tmp_path: Path) -> None:
    async with (
        serving(tmp_path, websockets=True) as (url, _),
        aiohttp.ClientSession() as http,
        http.get(f"{url}/v1/procesess") as response,
    ):
        assert response.status == 404
        message = (await response.json())["error"]["message"]
    assert message.startswith("GET /v1/procesess: Not Found; this server serves "), message
    for served in ("/healthz", "/v1/instances", "/v1/session", "/v1/workflows"):
        assert served in message, message
    assert "{id}" not in message, message


def test_a_url_on_every_interface_is_printed_with_this_machines_name() -> None:
    from stepstream.ops.api.serving import reachable

    host = socket.gethostname()
    assert reachable("http://0.0.0.0:8233") == f"http://{host}:8233"
    assert reachable("https://[::]:8233") == f"https://{host}:8233"
    assert reachable("http://127.0.0.1:8233") == "http://127.0.0.1:8233"
