"""``http://HOST:PORT`` and ``https://``: the client transport that talks to the
stepstream HTTP API (a ``stepstream dev`` process or the API service), the client side of
its ``/v1/session`` websocket, and the wire form that the API and its clients share.

Errors cross the wire as ``{"error": {"type": "<ClassName>", "message": ..., <fields>}}``
and become the same ``engine.errors`` class again on this side, found by name in an
explicit allow-list: the server's words never choose which code runs here.

Commands and short reads are requests on a pool of connections; waits (``result``) are
calls on one websocket session, so any number of waits never starves the pool. Options
of ``Client.connect``: ``token`` (the API's bearer token, default
``$STEPSTREAM_API_TOKEN``), ``tls_ca`` (a CA file to trust for https://, default
``$STEPSTREAM_TLS_CA``) and ``timeout`` (seconds per request).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import os
import ssl
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from stepstream.engine.codec import dump_json_text
from stepstream.engine.errors import (
    AccessDenied,
    ConnectionFailed,
    HistoryDiverged,
    InstanceFinished,
    InstanceNotPaused,
    InvalidPayload,
    PayloadTooLarge,
    ResultTimeout,
    StepstreamError,
    UndecodableRecord,
    UnknownInstance,
    UnknownWorkflow,
    WorkflowCancelled,
    WorkflowFailed,
)
from stepstream.engine.listing import InstancePage, ListQuery, Overview
from stepstream.engine.views import HistoryEntry, InstanceStatus
from stepstream.producers import trace_context
from stepstream.producers.client import Transport, register_transport

_WIRE_ERRORS: dict[str, type[StepstreamError]] = {
    cls.__name__: cls
    for cls in (
        StepstreamError,
        AccessDenied,
        UnknownWorkflow,
        InvalidPayload,
        PayloadTooLarge,
        UnknownInstance,
        InstanceFinished,
        InstanceNotPaused,
        WorkflowFailed,
        WorkflowCancelled,
        ResultTimeout,
        ConnectionFailed,
        UndecodableRecord,
        HistoryDiverged,
    )
}
# Keyword fields an error carries besides its message, sent along so that the client
# rebuilds the same exception (``WorkflowFailed.error_type`` and so on).
_ERROR_FIELDS: dict[type[StepstreamError], tuple[str, ...]] = {
    WorkflowFailed: ("instance_id", "error_type"),
    WorkflowCancelled: ("instance_id", "reason"),
    HistoryDiverged: ("key",),
}

# How much longer than the server-side wait a result request may take before the client
# gives up on the server itself.
_RESULT_MARGIN_S = 10.0
DEFAULT_REQUEST_TIMEOUT_S = 30.0
_CONNECTIONS = 100  # the pool for commands and reads (waits use the session instead)
# Bodies over this are streamed (aiohttp's own limit for bytes, TOO_LARGE_BYTES_BODY).
_STREAMED_BODY_BYTES = 1 << 20

# ``json.dumps(..., separators=...)`` builds an encoder per call; a call's arguments
# are made often enough for that to show.
_compact_json = json.JSONEncoder(separators=(",", ":")).encode

# The session websocket (``/v1/session``, see ``ops.api``): calls one session may have in
# flight (the server answers more with an error), calls per frame (a bigger frame closes
# the session) and the size a frame's text stays under (a bigger one closes it too).
SESSION_MAX_CALLS = 10_000
SESSION_FRAME_CALLS = 1_000
SESSION_FRAME_BYTES = 1024 * 1024
_HEARTBEAT_S = 20.0
# A command whose JSON is bigger goes as a request of its own, not on the session.
SESSION_COMMAND_BYTES = 64 * 1024

TOKEN_ENV = "STEPSTREAM_API_TOKEN"
TLS_CA_ENV = "STEPSTREAM_TLS_CA"


def wire_error_class(exc: StepstreamError) -> type[StepstreamError]:
    """The closest class of ``exc`` that the wire can name."""
    for cls in type(exc).__mro__:
        if _WIRE_ERRORS.get(cls.__name__) is cls:
            return cls
    return StepstreamError


def error_to_wire(exc: StepstreamError) -> dict[str, Any]:
    cls = wire_error_class(exc)
    body: dict[str, Any] = {"type": cls.__name__, "message": str(exc)}
    for name in _ERROR_FIELDS.get(cls, ()):
        body[name] = getattr(exc, name)
    return {"error": body}


def error_from_wire(raw: dict[str, Any]) -> StepstreamError:
    cls = _WIRE_ERRORS.get(str(raw.get("type")), StepstreamError)
    message = str(raw.get("message", ""))
    fields = {name: str(raw.get(name, "")) for name in _ERROR_FIELDS.get(cls, ())}
    return cls(message, **fields)


class SessionUnavailable(ConnectionFailed):
    """The server did not open the session websocket (not a refused token): an older
    server, or a proxy between that does not pass websockets. Nothing was sent."""


class _Link:
    """One websocket of a session and what belongs to it alone: the calls sent on it and
    awaiting their replies, and the calls waiting to be written to it. A call never
    moves to a later connection: if this one is lost, it fails."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.outbox: list[str] = []  # calls as JSON text, to write
        self.ready = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def send(self, text: str) -> None:
        self.outbox.append(text)
        self.ready.set()


class ApiSession:
    """One websocket to an API's ``/v1/session``: many calls in flight at once (at most
    ``SESSION_MAX_CALLS``; more wait here for a free slot), batched both ways. Connected
    on first use and again after a loss; calls in flight when the connection is lost
    fail with ``ConnectionFailed``. The websocket upgrade carries the session's headers
    (the bearer token) like any request."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str) -> None:
        self._http = http
        self._url = base_url.rstrip("/") + "/v1/session"
        self._link: _Link | None = None
        self._connecting = asyncio.Lock()
        self._slots = asyncio.Semaphore(SESSION_MAX_CALLS)
        self._ids = itertools.count(1)

    async def call(self, op: str, **args: Any) -> Any:
        return await self.call_json(op, _compact_json(args))

    async def call_json(self, op: str, args: str) -> Any:
        """A call whose arguments are ``args``, the text of a JSON object (checked by the
        caller: a value JSON cannot carry fails there, never in a frame shared with other
        calls)."""
        async with self._slots:
            link = await self._connect()
            call_id = next(self._ids)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            link.pending[call_id] = future
            link.send(_call_text(call_id, op, args))
            try:
                return await future
            except asyncio.CancelledError:
                if link.pending.pop(call_id, None) is not None and not link.ws.closed:
                    link.send(_call_text(call_id, "cancel", "{}"))
                raise

    async def open(self) -> None:
        await self._connect()

    async def _connect(self) -> _Link:
        link = self._link
        if link is not None and not link.ws.closed:
            return link
        async with self._connecting:
            link = self._link
            if link is not None and not link.ws.closed:
                return link
            try:
                ws = await self._http.ws_connect(self._url, heartbeat=_HEARTBEAT_S, max_msg_size=0)
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status in (401, 403):
                    raise refused(self._url, exc.status) from None
                raise SessionUnavailable(f"cannot open {self._url}: HTTP {exc.status}") from None
            except aiohttp.ClientConnectorCertificateError as exc:
                raise untrusted(self._url, exc) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise ConnectionFailed(
                    f"cannot reach stepstream at {self._url}: {exc}; is it running, and is the "
                    "address right?"
                ) from None
            link = self._link = _Link(ws)
            loop = asyncio.get_running_loop()
            link.tasks = [loop.create_task(self._read(link)), loop.create_task(self._write(link))]
            return link

    async def _write(self, link: _Link) -> None:
        # One writer: calls made while a frame is being written share the next one.
        ws, outbox = link.ws, link.outbox
        while not ws.closed:
            await link.ready.wait()
            link.ready.clear()
            while outbox:
                # Up to SESSION_FRAME_CALLS calls and SESSION_FRAME_BYTES (a character
                # takes up to 4 bytes in UTF-8) a frame.
                count, size = 1, len(outbox[0])
                while (
                    count < len(outbox)
                    and count < SESSION_FRAME_CALLS
                    and size + len(outbox[count]) < SESSION_FRAME_BYTES // 4
                ):
                    size += len(outbox[count]) + 1
                    count += 1
                frame = "[" + ",".join(outbox[:count]) + "]"
                del outbox[:count]
                try:
                    await ws.send_str(frame)
                except (aiohttp.ClientError, ConnectionError, RuntimeError):
                    return

    async def _read(self, link: _Link) -> None:
        ws, pending = link.ws, link.pending
        try:
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                for reply in json.loads(message.data):
                    future = pending.pop(reply.get("id"), None)
                    if future is None or future.done():
                        continue
                    if "error" in reply:
                        future.set_exception(error_from_wire(reply["error"]))
                    else:
                        future.set_result(reply.get("ok"))
        finally:
            why = f" ({ws.close_code}: {ws.exception() or 'closed'})" if ws.close_code else ""
            lost = ConnectionFailed(f"lost the session with {self._url}{why}")
            for future in pending.values():
                if not future.done():
                    future.set_exception(lost)
            pending.clear()
            link.outbox.clear()
            link.ready.set()  # lets the writer see the closed socket and end

    async def close(self) -> None:
        link = self._link
        if link is None:
            return
        await link.ws.close()
        for task in link.tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class HttpTransport:
    """One ``aiohttp.ClientSession`` for every request and one ``ApiSession`` for the
    waits; ``close()`` closes both."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        *,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        self._base = base_url.rstrip("/")
        self._session = session
        self._request_timeout = request_timeout
        self._calls = ApiSession(session, self._base)
        # Commands go on the session unless the server turned out not to take them there.
        self._session_commands = True
        # Requests take the pool's connections in the order they were made. aiohttp
        # hands a freed connection to whichever request asks next, so under a steady
        # load of more than _CONNECTIONS requests the ones already waiting could starve
        # until their timeout (measured: 400 of 500 concurrent starts failed after 30 s
        # while the other 100 went on); asyncio's semaphore is first come, first served.
        self._slots = asyncio.Semaphore(_CONNECTIONS)

    # Commands go as calls on the session (many share a frame: the server parses one
    # frame, not one request, for each of them); a big one goes as its own request.
    async def start(
        self, workflow: str, input: Any, instance_id: str, version: str | None = None
    ) -> str:
        body = {"workflow": workflow, "input": input, "instance_id": instance_id}
        if version is not None:
            body["version"] = version
        data = _encode(body, f"input of workflow {workflow!r}")
        answer = await self._command("start", data, "/v1/instances")
        return str(answer["instance_id"])

    async def send_event(
        self, instance_id: str, name: str, payload: Any, event_id: str | None = None
    ) -> None:
        body: dict[str, Any] = {"name": name, "payload": payload}
        if event_id is not None:
            body["event_id"] = event_id
        data = _encode(body, f"payload of event {name!r} for instance {instance_id}")
        await self._command("send_event", data, f"{_path(instance_id)}/events", instance_id)

    async def cancel(self, instance_id: str, reason: str) -> None:
        data = _encode({"reason": reason}, "cancel reason")
        await self._command("cancel_workflow", data, f"{_path(instance_id)}/cancel", instance_id)

    async def pause(self, instance_id: str) -> None:
        await self._command("pause", b"{}", f"{_path(instance_id)}/pause", instance_id)

    async def resume(self, instance_id: str) -> None:
        await self._command("resume", b"{}", f"{_path(instance_id)}/resume", instance_id)

    async def _command(
        self, op: str, body: bytes, path: str, instance_id: str | None = None
    ) -> Any:
        """``body`` (a JSON object, checked) as a session call, or POSTed to ``path``
        when it is big."""
        if len(body) > SESSION_COMMAND_BYTES or not self._session_commands:
            return await self._call("POST", path, data=body)
        extra = dict(trace_context.headers())  # the caller's trace, as headers would carry
        if instance_id is not None:
            extra["instance_id"] = instance_id
        args = body.decode()
        if extra:
            more = json.dumps(extra, separators=(",", ":"))[1:-1]
            args = "{" + more + "}" if args == "{}" else args[:-1] + "," + more + "}"
        try:
            async with asyncio.timeout(self._request_timeout):
                return await self._calls.call_json(op, args)
        except SessionUnavailable:
            self._session_commands = False  # nothing was sent: as a request, from now on
            return await self._call("POST", path, data=body)
        except InvalidPayload as exc:
            if not str(exc).startswith("unknown session call"):
                raise
            self._session_commands = False  # an older server: it applied nothing
            return await self._call("POST", path, data=body)
        except TimeoutError as exc:
            if isinstance(exc, StepstreamError):
                raise
            raise ConnectionFailed(
                f"stepstream at {self._base} did not answer {op} within "
                f"{self._request_timeout} s; check the server log, then retry"
            ) from None

    async def status(self, instance_id: str) -> InstanceStatus:
        return InstanceStatus.from_json(await self._call("GET", _path(instance_id)))

    async def result(self, instance_id: str, timeout: float | None) -> Any:
        # A call on the session: the server waits for the instance to finish (woken by
        # the commit, it does not poll) and answers at the latest after ``timeout``;
        # waiting holds no connection of the pool.
        limit = None if timeout is None else timeout + _RESULT_MARGIN_S
        try:
            async with asyncio.timeout(limit):
                return await self._calls.call("result", instance_id=instance_id, timeout=timeout)
        except TimeoutError as exc:
            if isinstance(exc, StepstreamError):
                raise
            raise ConnectionFailed(
                f"stepstream at {self._base} did not answer the wait for {instance_id} within "
                f"{limit} s; check the server log, then retry"
            ) from None

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        # Like result(): a call on the session, answered when the answer is durable.
        limit = None if timeout is None else timeout + _RESULT_MARGIN_S
        try:
            async with asyncio.timeout(limit):
                return await self._calls.call(
                    "reply", instance_id=instance_id, message_id=message_id, timeout=timeout
                )
        except TimeoutError as exc:
            if isinstance(exc, StepstreamError):
                raise
            raise ConnectionFailed(
                f"stepstream at {self._base} did not answer the wait for a reply of "
                f"{instance_id} within {limit} s; check the server log, then retry"
            ) from None

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        answer = await self._call("GET", f"{_path(instance_id)}/history")
        return [HistoryEntry.from_json(raw) for raw in answer["history"]]

    async def list(self, status: str | None) -> list[InstanceStatus]:
        params = {} if status is None else {"status": status}
        answer = await self._call("GET", "/v1/instances", params=params)
        return [InstanceStatus.from_json(raw) for raw in answer["instances"]]

    async def list_page(self, query: ListQuery) -> InstancePage:
        answer = await self._call("GET", "/v1/instances", params=query.params())
        return InstancePage.from_json(answer)

    async def overview(self) -> Overview:
        return Overview.from_json(await self._call("GET", "/v1/overview"))

    async def close(self) -> None:
        await self._calls.close()
        await self._session.close()

    async def close_session_only(self) -> None:
        """Close the websocket session, not the connection pool (another owns it)."""
        await self._calls.close()

    async def probe(self) -> None:
        """Open the websocket session now; ``ConnectionFailed`` if the server is not
        reachable."""
        await self._calls.open()

    @property
    def base_url(self) -> str:
        return self._base

    @property
    def request_timeout(self) -> float:
        return self._request_timeout

    @property
    def http(self) -> aiohttp.ClientSession:
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        *,
        data: bytes | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        return await self._send(method, path, data, params, self._request_timeout)

    async def _send(
        self,
        method: str,
        path: str,
        data: bytes | None,
        params: dict[str, str] | None,
        timeout: float | None,
    ) -> Any:
        url = URL(self._base + path, encoded=True)
        # A body this large, given as bytes, is written to the socket in one go while the
        # event loop waits (aiohttp warns so); as a stream it goes out a chunk at a time.
        # Smaller ones stay bytes: a stream costs a thread hand-off per chunk.
        body: bytes | io.BytesIO | None = data
        if data is not None and len(data) > _STREAMED_BODY_BYTES:
            body = io.BytesIO(data)
        try:
            async with (
                asyncio.timeout(timeout),
                self._slots,
                self._session.request(
                    method,
                    url,
                    data=body,
                    params=params,
                    headers=(
                        {"Content-Type": "application/json", **trace_context.headers()}
                        if data is not None
                        else None
                    ),
                    timeout=aiohttp.ClientTimeout(total=timeout),
                ) as response,
            ):
                status = response.status
                raw = await response.read()
        except aiohttp.ClientConnectorCertificateError as exc:
            raise untrusted(self._base, exc) from None
        except aiohttp.ClientConnectorSSLError as exc:
            raise ConnectionFailed(
                f"TLS with stepstream at {self._base} failed ({exc.os_error}); is it serving "
                "https (--tls-cert), and http:// vs https:// right?"
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise ConnectionFailed(
                f"cannot reach stepstream at {self._base}: is `stepstream dev` running? "
                f"({exc.os_error.strerror or exc}); start it, or pass --connect / "
                "STEPSTREAM_CONNECT with the right address"
            ) from None
        except aiohttp.ClientError as exc:
            raise ConnectionFailed(
                f"lost the connection to stepstream at {self._base} during {method} {path}: "
                f"{str(exc) or type(exc).__name__}; check the server log, then retry"
            ) from None
        except TimeoutError:
            raise ConnectionFailed(
                f"stepstream at {self._base} did not answer {method} {path} within {timeout} s "
                f"(counting any wait for one of this client's {_CONNECTIONS} connections); "
                "check the server log, then retry"
            ) from None
        return self._decode(method, path, status, raw)

    def _decode(self, method: str, path: str, status: int, raw: bytes) -> Any:
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = None
        if status < 400 and isinstance(body, dict):
            return body
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            raise error_from_wire(body["error"])
        snippet = raw[:200].decode("utf-8", "replace")
        raise StepstreamError(
            f"unexpected answer from {self._base} to {method} {path}: HTTP {status} {snippet!r}; "
            "is this the address of a stepstream API?"
        )


def refused(url: str, status: int) -> AccessDenied:
    """What a 401 or 403 on the websocket upgrade means (its body is not readable there)."""
    if status == 401:
        return AccessDenied(
            f"{url} needs a bearer token (the API's), or refused the one sent (HTTP 401); "
            f"pass token= to Client.connect, --token or {TOKEN_ENV}"
        )
    return AccessDenied(
        f"{url} refused the request (HTTP 403): the Host or Origin header is not one it "
        "answers to; connect by an address it serves, or allow it with --allowed-host"
    )


def untrusted(url: str, exc: aiohttp.ClientConnectorCertificateError) -> ConnectionFailed:
    return ConnectionFailed(
        f"the TLS certificate of {url} is not trusted ({exc.certificate_error}); pass the CA "
        f"that signed it as tls_ca= to Client.connect, --tls-ca or {TLS_CA_ENV}"
    )


def client_headers(token: str | None) -> dict[str, str]:
    """Headers of every request (and websocket upgrade) to a stepstream API."""
    headers = {"Accept": "application/json"}
    if token:
        if not _printable(token):
            raise StepstreamError(
                f"the API token holds spaces or characters outside printable ASCII; check "
                f"token= / --token / {TOKEN_ENV}"
            )
        headers["Authorization"] = f"Bearer {token}"
    return headers


def client_ssl(tls_ca: str | None) -> ssl.SSLContext | bool:
    """The TLS setting for https:// APIs: the system's trust, or also ``tls_ca``."""
    if not tls_ca:
        return True
    try:
        return ssl.create_default_context(cafile=tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise StepstreamError(
            f"cannot load the CA file {tls_ca!r} ({exc}); pass a PEM file as tls_ca= / "
            f"--tls-ca / {TLS_CA_ENV}"
        ) from None


def client_security(options: dict[str, Any]) -> tuple[str | None, str | None]:
    """Take ``token`` and ``tls_ca`` out of ``options`` (defaults from the environment)."""
    token = options.pop("token", None) or os.environ.get(TOKEN_ENV) or None
    tls_ca = options.pop("tls_ca", None) or os.environ.get(TLS_CA_ENV) or None
    return token, tls_ca


def _printable(token: str) -> bool:
    return token.isascii() and token.isprintable() and " " not in token


def _path(instance_id: str) -> str:
    return f"/v1/instances/{quote(instance_id, safe='')}"


def _encode(body: dict[str, Any], what: str) -> bytes:
    """Check the user's value here, before anything is sent."""
    return dump_json_text(body, what=what).encode()


async def _connect(url: str, options: dict[str, Any]) -> Transport:
    request_timeout = float(options.pop("timeout", DEFAULT_REQUEST_TIMEOUT_S))
    token, tls_ca = client_security(options)
    if options:
        raise StepstreamError(
            f"unknown options for {url}: {', '.join(sorted(options))} "
            "(known: timeout, token, tls_ca)"
        )
    parsed = URL(url)
    if not parsed.host:
        raise StepstreamError(f"cannot connect to {url!r}: no host; use http://HOST:PORT")
    headers = client_headers(token)
    connector = aiohttp.TCPConnector(limit=_CONNECTIONS, ssl=client_ssl(tls_ca))
    session = aiohttp.ClientSession(headers=headers, connector=connector)
    from stepstream.producers.http_routing import RoutedHttpTransport

    return RoutedHttpTransport(HttpTransport(url, session, request_timeout=request_timeout))


register_transport("http", _connect)
register_transport("https", _connect)


def _call_text(call_id: int, op: str, args: str) -> str:
    """A session call's JSON text: ``args`` (a JSON object's text) with its id and op."""
    head = f'{{"id":{call_id},"op":{json.dumps(op)}'
    return head + "}" if args == "{}" else head + "," + args[1:]
