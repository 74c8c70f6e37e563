"""The client side of an API's ``/v1/session`` websocket (``ops.api.session`` is the
server's): ``ApiSession`` keeps many calls in flight on one connection, batched both
ways, so any number of waits never holds a connection of the request pool."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from typing import Any

import aiohttp

from stepstream.engine.errors import ConnectionFailed
from stepstream.producers.http.security import refused, tls_failed, untrusted
from stepstream.producers.http.wire import (
    SESSION_FRAME_BYTES,
    SESSION_FRAME_CALLS,
    SESSION_MAX_CALLS,
    SESSION_PATH,
    ConnectionLost,
    call_text,
    error_from_wire,
)

_HEARTBEAT_S = 20.0
# How long close() waits for a websocket's socket to be gone once it is aborted.
_CLOSED_WAIT_S = 5.0

# ``json.dumps(..., separators=...)`` builds an encoder per call; a call's arguments
# are made often enough for that to show.
_compact_json = json.JSONEncoder(separators=(",", ":")).encode


class SessionUnavailable(ConnectionFailed):
    """The server did not open the session websocket (not a refused token): an older
    server, or a proxy between that does not pass websockets. Nothing was sent."""


class NotListening(ConnectionFailed):
    """No connection could be made to the address (refused, no route, unknown name):
    nothing was sent. A kafka:// client takes a worker whose address says so for
    killed, not slow."""


class _Link:
    """One websocket of a session and what belongs to it alone: the calls sent on it and
    awaiting their replies, and the calls waiting to be written to it. A call never
    moves to a later connection: if this one is lost, it fails."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        # The connection under the websocket, kept so that close() can end the socket
        # itself (see ``_socket_gone``). aiohttp has no public accessor for it.
        connection = ws._response.connection
        self.protocol = connection.protocol if connection is not None else None
        self.transport = self.protocol.transport if self.protocol is not None else None
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
    fail with ``ConnectionLost``. The websocket upgrade carries the session's headers
    (the bearer token) like any request."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str) -> None:
        self._http = http
        self._url = base_url.rstrip("/") + SESSION_PATH
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
            link.send(call_text(call_id, op, args))
            try:
                return await future
            except asyncio.CancelledError:
                if link.pending.pop(call_id, None) is not None and not link.ws.closed:
                    link.send(call_text(call_id, "cancel", "{}"))
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
            except aiohttp.ClientConnectorSSLError as exc:  # something listens: TLS failed
                raise tls_failed(self._url, exc) from None
            except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
                raise NotListening(
                    f"cannot reach stepstream at {self._url}: {exc}; is it running, and is the "
                    "address right?"
                ) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise ConnectionFailed(
                    f"lost the connection to stepstream at {self._url} while opening its "
                    f"session: {str(exc) or type(exc).__name__}; check the server log, then "
                    "retry"
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
            for future in pending.values():
                if not future.done():
                    future.set_exception(ConnectionLost(f"lost the session with {self._url}{why}"))
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
        await _socket_gone(link)


async def _socket_gone(link: _Link) -> None:
    """Ends the websocket's socket and waits until it is closed. Over TLS, the
    websocket's close leaves the connection in TLS's own closing handshake, which the
    session's pool does not track: a program that ends its event loop right after (any
    ``asyncio.run``) would leave the socket open, and Python warns of an unclosed
    transport. The websocket's own closing handshake is done by then, so nothing is
    lost by aborting what remains."""
    protocol, transport = link.protocol, link.transport
    if protocol is None or transport is None:
        return
    closed = protocol.closed  # None once the socket is gone
    if closed is None:
        return
    transport.abort()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.shield(closed), _CLOSED_WAIT_S)
