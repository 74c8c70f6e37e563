"""The HTTP API: the JSON face of a ``Transport`` (``stepstream dev``, the API service).

Every route maps onto one transport call; this module owns only the HTTP side of it:
request validation, status codes and the error body
``{"error": {"type": "<ClassName>", "message": ...}}`` (see ``producers.http`` for the
wire form both sides share). Request bodies are parsed as JSON and nothing else; who may
call at all is ``ops.api_security``'s concern.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import WSCloseCode, web

from engine.codec import parse_json_text
from engine.errors import (
    ConnectionFailed,
    InstanceFinished,
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
from engine.listing import ListQuery
from engine.state import Status
from ops.api_security import ApiSecurity
from ops.ui.routes import TransportSource, add_ui_routes
from producers import trace_context
from producers.client import Transport
from producers.http import (
    SESSION_FRAME_BYTES,
    SESSION_FRAME_CALLS,
    SESSION_MAX_CALLS,
    error_to_wire,
    wire_error_class,
)

if TYPE_CHECKING:
    from ops.metrics import Observability

log = logging.getLogger("stepstream.api")

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024

_STATUS_CODES: dict[type[StepstreamError], int] = {
    InvalidPayload: 400,
    UnknownInstance: 404,
    UnknownWorkflow: 404,
    InstanceFinished: 409,
    InstanceNotPaused: 409,
    PayloadTooLarge: 413,
    WorkflowFailed: 422,
    WorkflowCancelled: 422,
    ResultTimeout: 408,
    # This server cannot answer for that instance now (a worker that does not own its
    # partition); a client asks again, elsewhere.
    ConnectionFailed: 503,
}
_STATUSES = tuple(s.value for s in Status)
# Any of these asks ``GET /v1/instances`` for one page (``engine.listing``) rather than all.
_PAGE_PARAMS = frozenset({"limit", "after", "workflow", "prefix"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class CommandWaiter(Protocol):
    """For clients that publish commands themselves (Kafka): may this instance take a
    command, and is the one published settled (``GET /v1/commands/{id}``)?"""

    def finished_status(self, instance_id: str) -> str | None:
        """The status of a finished instance, None if it is not finished; raises
        ``UnknownInstance`` if there is none."""
        ...

    async def wait_settled(
        self, command_id: str, instance_id: str | None, timeout: float | None
    ) -> str | None:
        """None once applied, the reason once dead-lettered; ``ResultTimeout`` if not
        settled within ``timeout`` seconds."""
        ...


SESSIONS: web.AppKey[_Session] = web.AppKey("sessions")


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
) -> web.Application:
    """The API over ``transport``. ``registry_names`` answers ``GET /v1/workflows``;
    ``commands`` (if given) ``GET /v1/commands/{id}?instance=ID&timeout=S``. ``security``
    (token, allowed hosts; see ``ops.api_security``) guards every route, and
    ``served_hosts`` are the names the server is reached by (bound host, advertised
    host). ``observability`` adds ``/metrics`` and ``/readyz``. ``app[SESSIONS]`` counts
    the websocket sessions and their calls. ``ui_transport`` gives the transport the web
    UI reads the whole deployment through (default: ``transport``, which covers it unless
    this is one worker of several)."""
    api = _Api(transport, registry_names, max_body_bytes, commands)
    guard = (security or ApiSecurity()).guard(served_hosts)
    app = web.Application(
        client_max_size=max_body_bytes, middlewares=[guard, api.errors, _join_trace]
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
    app.router.add_post("/v1/instances/{id}/pause", api.pause)
    app.router.add_post("/v1/instances/{id}/resume", api.resume)
    if commands is not None:
        app.router.add_get("/v1/commands/{id}", api.command)
    session = _Session(transport, commands, max_body_bytes)
    app[SESSIONS] = session
    app.router.add_get("/v1/session", session.serve)
    app.on_shutdown.append(session.close_all)
    # The overview and the web UI (ops.ui), kept in one block.
    app.router.add_get("/v1/overview", api.overview)
    add_ui_routes(app, ui_transport or functools.partial(_ready, transport), registry_names)
    return app


async def _ready(transport: Transport) -> Transport:
    return transport


class _Api:
    def __init__(
        self,
        transport: Transport,
        registry_names: Callable[[], dict[str, list[str]]] | None,
        max_body_bytes: int,
        commands: CommandWaiter | None = None,
    ) -> None:
        self._transport = transport
        self._registry_names = registry_names
        self._max_body_bytes = max_body_bytes
        self._commands = commands

    @web.middleware
    async def errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except StepstreamError as exc:
            return _error_response(exc)
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
                message += "; the API serves /healthz, /v1/workflows and /v1/instances, the UI /ui"
            body = {
                "error": {"type": exc.__class__.__name__.removeprefix("HTTP"), "message": message}
            }
            return web.json_response(body, status=exc.status)
        except Exception:
            log.exception("request failed method=%s path=%s", request.method, request.path)
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
            request, required=("workflow",), optional=("input", "instance_id", "version")
        )
        workflow = _string(body, "workflow")
        instance_id = _string(body, "instance_id") if body.get("instance_id") is not None else ""
        # A version pins the instance to it; absent or null, it gets the latest.
        version = _string(body, "version") if body.get("version") is not None else None
        started = await self._transport.start(
            workflow, body.get("input"), instance_id or str(uuid.uuid4()), version
        )
        return web.json_response({"instance_id": started}, status=201)

    async def send_event(self, request: web.Request) -> web.Response:
        body = await _body(request, required=("name",), optional=("payload", "event_id"))
        event_id = _string(body, "event_id") if body.get("event_id") is not None else None
        await self._transport.send_event(
            _instance_id(request), _string(body, "name"), body.get("payload"), event_id
        )
        return _accepted()

    async def cancel(self, request: web.Request) -> web.Response:
        body = await _body(request, optional=("reason",))
        reason = _string(body, "reason", allow_empty=True) if "reason" in body else ""
        await self._transport.cancel(_instance_id(request), reason)
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
        return web.json_response(status.to_json())

    async def history(self, request: web.Request) -> web.Response:
        entries = await self._transport.history(_instance_id(request))
        return web.json_response({"history": [e.to_json() for e in entries]})

    async def list(self, request: web.Request) -> web.Response:
        status = request.query.get("status")
        if status is not None and status not in _STATUSES:
            raise InvalidPayload(f"unknown status {status!r}; use one of {', '.join(_STATUSES)}")
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
        reason = await self._commands.wait_settled(
            command_id, request.query.get("instance") or None, _timeout(request)
        )
        return web.json_response({"command_id": command_id, "settled": True, "reason": reason})

    async def result(self, request: web.Request) -> web.Response:
        # Waits here, woken by the engine when the instance finishes: one long request.
        timeout = _timeout(request)
        value = await self._transport.result(_instance_id(request), timeout)
        return web.json_response({"status": "completed", "result": value})


class _Session:
    """``GET /v1/session``: the reads and waits of the API over one websocket, for clients
    that make many at once (the kafka:// and http:// clients). A text frame is a JSON array
    of calls ``{"id": n, "op": "status"|"history"|"result"|"finished"|"settled"|"cancel",
    ...}``; replies ``{"id": n, "ok": ...}`` or ``{"id": n, "error": {"type": ...,
    "message": ...}}`` come back batched, in whatever order the calls finish. Much cheaper
    per call than a request.

    What one client can hold: ``SESSION_MAX_CALLS`` calls running (a call over that, or
    with the id of a call still running, is answered with an error at once), frames of at
    most ``SESSION_FRAME_CALLS`` calls and the server's body limit in bytes (more closes
    the session), and no new frame is read while ``SESSION_FRAME_CALLS`` replies wait to
    be written (a client that does not read stops being served). So a session holds at
    most ``SESSION_MAX_CALLS`` running calls and about twice that many replies. Closing
    the session cancels its calls.
    """

    def __init__(
        self, transport: Transport, commands: CommandWaiter | None, max_body_bytes: int
    ) -> None:
        self._transport = transport
        self._commands = commands
        self._max = max_body_bytes
        self._open: set[_Connection] = set()

    @property
    def calls_in_flight(self) -> int:
        """Calls running now, over every open session."""
        return sum(len(c.calls) for c in self._open)

    @property
    def sessions(self) -> int:
        return len(self._open)

    async def close_all(self, app: web.Application) -> None:
        """On shutdown: a session would otherwise keep the server waiting for it."""
        for connection in list(self._open):
            await connection.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")

    async def serve(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=self._max)
        await ws.prepare(request)
        connection = _Connection(self, ws)
        self._open.add(connection)
        try:
            await connection.serve()
        finally:
            self._open.discard(connection)
        return ws

    async def _call(self, call: dict[str, Any]) -> Any:
        op = call.get("op")
        instance_id = call.get("instance_id")
        if not isinstance(instance_id, str) or not instance_id:
            raise InvalidPayload(f"session call {op!r} needs a non-empty instance_id")
        timeout = _session_timeout(call.get("timeout"))
        if op == "status":
            return (await self._transport.status(instance_id)).to_json()
        if op == "history":
            return [e.to_json() for e in await self._transport.history(instance_id)]
        if op == "result":
            return await self._transport.result(instance_id, timeout)
        if op == "reply":
            message_id = call.get("message_id")
            if not isinstance(message_id, str) or not message_id:
                raise InvalidPayload("session call 'reply' needs a message_id")
            return await self._transport.reply(instance_id, message_id, timeout)
        if op == "finished" and self._commands is not None:
            return self._commands.finished_status(instance_id)
        if op == "settled" and self._commands is not None:
            command_id = call.get("command_id")
            if not isinstance(command_id, str) or not command_id:
                raise InvalidPayload("session call 'settled' needs a command_id")
            return await self._commands.wait_settled(command_id, instance_id, timeout)
        raise InvalidPayload(
            f"unknown session call {op!r}; known: status, history, result, reply, finished, settled"
        )


class _Connection:
    """One client's session: its running calls and the replies waiting to be written."""

    def __init__(self, session: _Session, ws: web.WebSocketResponse) -> None:
        self.session = session
        self.ws = ws
        self.calls: dict[int, asyncio.Task[None]] = {}
        self._replies: list[str] = []
        self._ready = asyncio.Event()  # replies to write
        self._written = asyncio.Event()  # the replies were written

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        sender = loop.create_task(self._send())
        try:
            async for message in self.ws:
                if message.type != web.WSMsgType.TEXT:
                    continue
                # Backpressure: a client that does not read its replies is not served more.
                while len(self._replies) >= SESSION_FRAME_CALLS and not sender.done():
                    self._written.clear()
                    await self._written.wait()
                if sender.done() or not await self._take(message.data):
                    break
        finally:
            tasks = [*self.calls.values(), sender]
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            self.calls.clear()

    async def _take(self, text: str) -> bool:
        """Start the calls of one frame; False if the frame ended the session."""
        try:
            batch = parse_json_text(text, what="session frame")
        except InvalidPayload as exc:
            await self.ws.close(code=WSCloseCode.UNSUPPORTED_DATA, message=_close_reason(exc))
            return False
        if not isinstance(batch, list):
            await self.ws.close(
                code=WSCloseCode.UNSUPPORTED_DATA, message=b"frames must be JSON arrays of calls"
            )
            return False
        if len(batch) > SESSION_FRAME_CALLS:
            await self.ws.close(
                code=WSCloseCode.MESSAGE_TOO_BIG,
                message=f"at most {SESSION_FRAME_CALLS} calls per frame".encode(),
            )
            return False
        loop = asyncio.get_running_loop()
        for call in batch:
            call_id = call.get("id") if isinstance(call, dict) else None
            if isinstance(call_id, bool) or not isinstance(call_id, int):
                self._refuse(None, "every session call needs an integer id")
                continue
            assert isinstance(call, dict)
            if call.get("op") == "cancel":
                task = self.calls.pop(call_id, None)
                if task is not None:
                    task.cancel()
                continue
            if call_id in self.calls:
                self._refuse(
                    call_id,
                    f"call id {call_id} is still in flight in this session; use a new id "
                    "for each call",
                )
                continue
            if len(self.calls) >= SESSION_MAX_CALLS:
                self._refuse(
                    call_id,
                    f"this session has {SESSION_MAX_CALLS} calls in flight, the most it "
                    "takes; wait for some to finish, or cancel them",
                )
                continue
            task = loop.create_task(self._run(call_id, call))
            self.calls[call_id] = task
            task.add_done_callback(functools.partial(self._done, call_id))
        return True

    async def _run(self, call_id: int, call: dict[str, Any]) -> None:
        try:
            reply: dict[str, Any] = {"id": call_id, "ok": await self.session._call(call)}
        except StepstreamError as exc:
            reply = {"id": call_id, **error_to_wire(exc)}
        except Exception:
            log.exception("session call failed op=%s", call.get("op"))
            reply = {"id": call_id, **_internal_error()}
        self._done(call_id, asyncio.current_task())
        self._queue(reply)

    def _done(self, call_id: int, task: object) -> None:
        # Also on cancellation, which may come before the call ever ran.
        if self.calls.get(call_id) is task:
            del self.calls[call_id]

    def _refuse(self, call_id: int | None, message: str) -> None:
        self._queue({"id": call_id, "error": {"type": "InvalidPayload", "message": message}})

    def _queue(self, reply: dict[str, Any]) -> None:
        try:
            text = json.dumps(reply, separators=(",", ":"))
        except (TypeError, ValueError):
            log.exception("session reply not encodable id=%s", reply.get("id"))
            text = json.dumps({"id": reply.get("id"), **_internal_error()})
        self._replies.append(text)
        self._ready.set()

    async def _send(self) -> None:
        # One sender: replies that finish while a frame is being written share the next,
        # up to about SESSION_FRAME_BYTES each.
        ws, replies = self.ws, self._replies
        try:
            while not ws.closed:
                await self._ready.wait()
                self._ready.clear()
                while replies:
                    size, count = 0, 0
                    while count < len(replies) and (count == 0 or size < SESSION_FRAME_BYTES):
                        size += len(replies[count]) + 1
                        count += 1
                    frame = "[" + ",".join(replies[:count]) + "]"
                    del replies[:count]
                    await ws.send_str(frame)
                self._written.set()
        finally:
            self._written.set()  # the reader must not wait for a sender that is gone


def _session_timeout(raw: object) -> float | None:
    if raw is None:
        return None
    if (
        isinstance(raw, bool)
        or not isinstance(raw, int | float)
        or not math.isfinite(raw)
        or raw < 0
    ):
        raise InvalidPayload(f"timeout={raw!r} is not a number of seconds >= 0")
    return float(raw)


def _internal_error() -> dict[str, Any]:
    message = "internal error; the traceback is in the server log"
    return {"error": {"type": "InternalError", "message": message}}


def _close_reason(exc: Exception) -> bytes:
    # A close frame's reason is at most 123 bytes.
    return str(exc).encode()[:120]


def _error_response(exc: StepstreamError) -> web.Response:
    cls = wire_error_class(exc)
    code = next((_STATUS_CODES[c] for c in cls.__mro__ if c in _STATUS_CODES), 400)
    return web.json_response(error_to_wire(exc), status=code)


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
    missing = [name for name in required if name not in body]
    unknown = sorted(body.keys() - {*required, *optional})
    if missing or unknown:
        known = ", ".join((*required, *optional)) or "none"
        problems = [f"missing {', '.join(missing)}"] if missing else []
        problems += [f"unknown {', '.join(unknown)}"] if unknown else []
        raise InvalidPayload(f"request body fields: {'; '.join(problems)} (fields: {known})")
    return body


def _string(body: dict[str, Any], name: str, *, allow_empty: bool = False) -> str:
    value = body.get(name)
    if not isinstance(value, str) or (not value and not allow_empty):
        kind = "a string" if allow_empty else "a non-empty string"
        raise InvalidPayload(f"field {name!r} must be {kind}, got {value!r}")
    return value
