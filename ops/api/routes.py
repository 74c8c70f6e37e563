"""The HTTP API: the JSON face of a ``Transport`` (``stepstream dev``, the API service).

Every route maps onto one transport call; this module owns only the HTTP side of it:
request validation, status codes and the error body
``{"error": {"type": "<ClassName>", "message": ...}}`` (see ``producers.http.wire`` for
the wire form both sides share). Request bodies are parsed as JSON and nothing else; who may
call at all is ``ops.api.security``'s concern.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from stepstream.engine.errors import (
    ConnectionFailed,
    InstanceExists,
    InstanceFinished,
    InstanceNotFailed,
    InstanceNotPaused,
    InvalidPayload,
    PayloadTooLarge,
    ResultTimeout,
    StepstreamError,
    UnknownInstance,
    UnknownWorkflow,
    WorkflowCancelled,
    WorkflowFailed,
)
from stepstream.engine.reads.listing import ListQuery, check_status
from stepstream.engine.wire.codec import parse_json_text
from stepstream.ops.api.fields import check_fields, queue_fields, string_field
from stepstream.ops.api.limits import ApiLimits, Pending, server_fault
from stepstream.ops.api.repair import add_repair_routes
from stepstream.ops.api.schedule_routes import API_ROOT as SCHEDULES_API
from stepstream.ops.api.schedule_routes import UI_ROOT as SCHEDULES_UI
from stepstream.ops.api.schedule_routes import add_schedule_routes
from stepstream.ops.api.security import ApiSecurity
from stepstream.ops.api.session import Session
from stepstream.ops.api.session_calls import CommandWaiter
from stepstream.ops.api.ui.routes import TransportSource, add_ui_routes
from stepstream.producers import trace_context
from stepstream.producers.client import Transport
from stepstream.producers.http.wire import (
    SESSION_PATH,
    ServerUnavailable,
    error_to_wire,
    wire_error_class,
)
from stepstream.producers.queue_positions import with_queue_positions

if TYPE_CHECKING:
    from stepstream.ops.telemetry.metrics import Observability

log = logging.getLogger("stepstream.api")

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024

_STATUS_CODES: dict[type[StepstreamError], int] = {
    InvalidPayload: 400,
    UnknownInstance: 404,
    UnknownWorkflow: 404,
    InstanceExists: 409,
    InstanceFinished: 409,
    InstanceNotPaused: 409,
    InstanceNotFailed: 409,
    PayloadTooLarge: 413,
    WorkflowFailed: 422,
    WorkflowCancelled: 422,
    ResultTimeout: 408,
    # This server cannot answer for that instance now (a worker that does not own its
    # partition); a client asks again, elsewhere.
    ConnectionFailed: 503,
    # Nor can it take the call now: at its limit of pending calls, or its disk failed
    # (the server's fault, never the client's: a 4xx would say "do not retry").
    ServerUnavailable: 503,
}
# What a 503 for a ConnectionFailed says to wait: what serves the instance is away for a
# moment (a worker handing its partition over, an engine process starting again).
CONNECTION_RETRY_AFTER_S = 2.0
# Any of these asks ``GET /v1/instances`` for one page (``engine.reads.listing``) rather than all.
_PAGE_PARAMS = frozenset(
    {"limit", "after", "workflow", "prefix", "order", "since", "until", "where"}
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _check_params(query: Any, known: frozenset[str]) -> None:
    """Refuse a parameter of ``query`` (a request's multidict) that the call does not take
    (a misspelled filter would otherwise be dropped, and every instance listed) or one
    given twice."""
    unknown = sorted(set(query) - known)
    if unknown:
        raise InvalidPayload(
            f"unknown query parameter {', '.join(map(repr, unknown))}; this call takes "
            + ", ".join(sorted(known))
        )
    twice = sorted({name for name in query if len(query.getall(name)) > 1})
    if twice:
        raise InvalidPayload(f"query parameter {', '.join(map(repr, twice))} given more than once")


SESSIONS: web.AppKey[Session] = web.AppKey("sessions")
PENDING: web.AppKey[Pending] = web.AppKey("pending")


@web.middleware
async def _join_trace(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A request that carries W3C trace context: the commands it publishes join it."""
    with trace_context.joined(request.headers):
        return await handler(request)


def make_app(
    transport: Transport,
    *,
    registry_names: Callable[[], dict[str, list[str]]] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    commands: CommandWaiter | None = None,
    security: ApiSecurity | None = None,
    served_hosts: tuple[str, ...] = (),
    observability: Observability | None = None,
    ui_transport: TransportSource | None = None,
    limits: ApiLimits | None = None,
) -> web.Application:
    """The API over ``transport``. ``registry_names`` answers ``GET /v1/workflows``;
    ``commands`` (if given) ``GET /v1/commands/{id}?instance=ID&timeout=S``. ``security``
    (token, allowed hosts; see ``ops.api.security``) guards every route, and
    ``served_hosts`` are the names the server is reached by (bound host, advertised
    host). ``observability`` adds ``/metrics`` and ``/readyz``. ``app[SESSIONS]`` counts
    the websocket sessions and their calls. ``ui_transport`` gives the transport the web
    UI reads the whole deployment through (default: ``transport``, which covers it unless
    this is one worker of several). ``limits`` bound what all clients hold at once
    (``ops.api.limits``; default: ``STEPSTREAM_MAX_PENDING`` or its default);
    ``app[PENDING]`` counts it."""
    limits = limits or ApiLimits.from_env()
    pending = Pending(limits.max_pending)
    api = _Api(transport, registry_names, max_body_bytes, commands, pending)
    guard = (security or ApiSecurity()).guard(served_hosts)
    # Outermost: request metrics see every answer, refusals and errors included.
    http = observability.http if observability is not None else None
    counted = [http.middleware] if http is not None else []
    app = web.Application(
        client_max_size=max_body_bytes, middlewares=[*counted, guard, api.errors, _join_trace]
    )
    app.router.add_get("/healthz", api.healthz)
    if observability is not None:
        observability.add_routes(app)
    app.router.add_get("/v1/workflows", api.workflows)
    app.router.add_post("/v1/instances", api.start)
    app.router.add_get("/v1/instances", api.list)
    app.router.add_get("/v1/instances/{id}", api.status)
    app.router.add_get("/v1/instances/{id}/history", api.history)
    app.router.add_get("/v1/instances/{id}/result", api.result)
    app.router.add_post("/v1/instances/{id}/events", api.send_event)
    app.router.add_post("/v1/instances/{id}/cancel", api.cancel)
    app.router.add_post("/v1/instances/{id}/terminate", api.terminate)
    app.router.add_post("/v1/instances/{id}/pause", api.pause)
    app.router.add_post("/v1/instances/{id}/resume", api.resume)
    add_repair_routes(app, transport)
    if commands is not None:
        app.router.add_get("/v1/commands/{id}", api.command)
    session = Session(transport, commands, max_body_bytes, limits, pending)
    app[SESSIONS] = session
    app[PENDING] = pending
    if observability is not None:
        observability.count_api(pending, session)
    app.router.add_get(SESSION_PATH, session.serve)
    app.on_shutdown.append(session.close_all)
    # The overview and the web UI (ops.api.ui), kept in one block.
    app.router.add_get("/v1/overview", api.overview)
    add_ui_routes(app, ui_transport or functools.partial(_ready, transport), registry_names)
    add_schedule_routes(app, SCHEDULES_API, functools.partial(_ready, transport))
    add_schedule_routes(app, SCHEDULES_UI, ui_transport or functools.partial(_ready, transport))
    return app


async def _ready(transport: Transport) -> Transport:
    return transport


class _Api:
    def __init__(
        self,
        transport: Transport,
        registry_names: Callable[[], dict[str, list[str]]] | None,
        max_body_bytes: int,
        commands: CommandWaiter | None,
        pending: Pending,
    ) -> None:
        self._transport = transport
        self._registry_names = registry_names
        self._max_body_bytes = max_body_bytes
        self._commands = commands
        self._pending = pending

    @web.middleware
    async def errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except StepstreamError as exc:
            return _error_response(server_fault(exc) or exc)
        except web.HTTPRequestEntityTooLarge:
            return _error_response(
                PayloadTooLarge(
                    f"request body is over the limit of {self._max_body_bytes} bytes; "
                    "store large data elsewhere and pass a reference"
                )
            )
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = f"{request.method} {request.path}: {exc.reason}"
            if exc.status == 404:
                message += f"; this server serves {', '.join(_served_roots(request.app))}"
            body = {
                "error": {"type": exc.__class__.__name__.removeprefix("HTTP"), "message": message}
            }
            return web.json_response(body, status=exc.status)
        except Exception:
            log.exception("request failed", extra={"method": request.method, "path": request.path})
            body = {
                "error": {
                    "type": "InternalError",
                    "message": f"internal error while serving {request.method} {request.path}; "
                    "the traceback is in the server log",
                }
            }
            return web.json_response(body, status=500)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def workflows(self, request: web.Request) -> web.Response:
        names = self._registry_names() if self._registry_names is not None else {}
        return web.json_response({"workflows": names})

    async def start(self, request: web.Request) -> web.Response:
        body = await _body(
            request,
            required=("workflow",),
            optional=("input", "instance_id", "version", "if_exists", "priority", "queue_key"),
        )
        workflow = string_field(body, "workflow")
        instance_id = (
            string_field(body, "instance_id") if body.get("instance_id") is not None else ""
        )
        # A version pins the instance to it; absent or null, it gets the latest.
        version = string_field(body, "version") if body.get("version") is not None else None
        # What a start of an existing id does (``Client.start(if_exists=)``).
        if_exists = string_field(body, "if_exists") if "if_exists" in body else "return"
        started = await self._transport.start(
            workflow,
            body.get("input"),
            instance_id or str(uuid.uuid4()),
            version,
            if_exists,
            **queue_fields(body),
        )
        return web.json_response({"instance_id": started}, status=201)

    async def send_event(self, request: web.Request) -> web.Response:
        body = await _body(request, required=("name",), optional=("payload", "event_id"))
        event_id = string_field(body, "event_id") if body.get("event_id") is not None else None
        await self._transport.send_event(
            _instance_id(request), string_field(body, "name"), body.get("payload"), event_id
        )
        return _accepted()

    async def cancel(self, request: web.Request) -> web.Response:
        body = await _body(request, optional=("reason",))
        reason = string_field(body, "reason", allow_empty=True) if "reason" in body else ""
        await self._transport.cancel(_instance_id(request), reason)
        return _accepted()

    async def terminate(self, request: web.Request) -> web.Response:
        body = await _body(request, optional=("reason",))
        reason = string_field(body, "reason", allow_empty=True) if "reason" in body else ""
        await self._transport.terminate(_instance_id(request), reason)
        return _accepted()

    async def pause(self, request: web.Request) -> web.Response:
        await _body(request)
        await self._transport.pause(_instance_id(request))
        return _accepted()

    async def resume(self, request: web.Request) -> web.Response:
        await _body(request)
        await self._transport.resume(_instance_id(request))
        return _accepted()

    async def status(self, request: web.Request) -> web.Response:
        status = await self._transport.status(_instance_id(request))
        status = await with_queue_positions(self._transport, status)
        return web.json_response(status.to_json())

    async def history(self, request: web.Request) -> web.Response:
        entries = await self._transport.history(_instance_id(request))
        return web.json_response({"history": [e.to_json() for e in entries]})

    async def list(self, request: web.Request) -> web.Response:
        _check_params(request.query, _PAGE_PARAMS | {"status"})
        status = check_status(request.query.get("status"))
        if request.query.keys() & _PAGE_PARAMS:
            page = await self._transport.list_page(ListQuery.from_params(request.query))
            return web.json_response(page.to_json())
        instances = await self._transport.list(status)
        return web.json_response({"instances": [i.to_json() for i in instances]})

    async def overview(self, request: web.Request) -> web.Response:
        return web.json_response((await self._transport.overview()).to_json())

    async def command(self, request: web.Request) -> web.Response:
        # Waits here, woken by the commit that settles the command: one long request.
        assert self._commands is not None
        command_id = request.match_info["id"]
        instance_id = request.query.get("instance")
        if not instance_id:
            raise InvalidPayload(
                f"GET /v1/commands/{command_id} needs ?instance=ID, the instance the "
                "command was sent to: a command id (an event id) is unique on its "
                "instance only"
            )
        timeout = _timeout(request)
        with self._waiting():
            reason = await self._commands.wait_settled(command_id, instance_id, timeout)
        return web.json_response({"command_id": command_id, "settled": True, "reason": reason})

    async def result(self, request: web.Request) -> web.Response:
        # Waits here, woken by the engine when the instance finishes: one long request.
        timeout = _timeout(request)
        with self._waiting():
            value = await self._transport.result(_instance_id(request), timeout)
        return web.json_response({"status": "completed", "result": value})

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """A long request holds a place in the server's bound of pending calls while it
        waits; ``ServerBusy`` (503) if there is none."""
        if not self._pending.take(wait=True):
            raise self._pending.busy()
        try:
            yield
        finally:
            self._pending.release(waits=1)


def _error_response(exc: StepstreamError) -> web.Response:
    cls = wire_error_class(exc)
    code = next((_STATUS_CODES[c] for c in cls.__mro__ if c in _STATUS_CODES), 400)
    headers = None
    if isinstance(exc, ServerUnavailable):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
    elif code == 503:  # ConnectionFailed: what serves it is away (an engine process restarting)
        headers = {"Retry-After": str(math.ceil(CONNECTION_RETRY_AFTER_S))}
    return web.json_response(error_to_wire(exc), status=code, headers=headers)


def _accepted() -> web.Response:
    return web.json_response({"ok": True}, status=202)


def _instance_id(request: web.Request) -> str:
    return request.match_info["id"]


def _timeout(request: web.Request) -> float | None:
    raw = request.query.get("timeout")
    if raw is None or raw == "":
        return None
    try:
        timeout = float(raw)
    except ValueError:
        timeout = math.nan
    if not math.isfinite(timeout) or timeout < 0:
        raise InvalidPayload(f"timeout={raw!r} is not a number of seconds >= 0")
    return timeout


async def _body(
    request: web.Request, *, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The request's JSON object, with exactly the fields a route knows about."""
    raw = await request.read()
    if not raw.strip():
        body: Any = {}
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidPayload("request body is not valid JSON: it is not UTF-8 text") from None
        body = parse_json_text(text, what="request body")
    if not isinstance(body, dict):
        raise InvalidPayload(f"request body must be a JSON object, not {type(body).__name__}")
    check_fields(body.keys(), required, optional, what="request body")
    return body


def _served_roots(app: web.Application) -> list[str]:
    """The paths this app serves, to the first level under ``/v1`` (``/v1/instances``
    for all of ``/v1/instances/{id}/...``), for a 404 to say what there is."""
    roots = set()
    for resource in app.router.resources():
        parts = resource.canonical.strip("/").split("/")
        depth = 2 if parts[0] == "v1" and len(parts) > 1 else 1
        roots.add("/" + "/".join(parts[:depth]))
    return sorted(roots)
