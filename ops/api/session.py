"""The API's ``/v1/session`` websocket: many calls of one client over one connection,
batched both ways (see ``producers.http.session`` for the client side).

A text frame is a JSON array of calls ``{"id": n, "op": ..., <arguments>}``; replies come
back as arrays of ``{"id": n, "ok": <value>}`` or ``{"id": n, "error": {...}}``, in any
order. Reads and waits (status, history, result, reply, finished, settled) and commands
(start, send_event, cancel_workflow, pause, resume) are calls; ``{"id": n, "op":
"cancel"}`` withdraws call n.

What each call does is ``ops.api.session_calls``; one client's connection (its frames,
limits and replies) is ``ops.api.session_connection``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import WSCloseCode, web

from stepstream.ops.api.limits import ApiLimits, Pending
from stepstream.ops.api.session_calls import OTHER_OP, SESSION_OPS, CommandWaiter, SessionCalls
from stepstream.ops.api.session_connection import SessionConnection
from stepstream.producers.client import Transport

# How long a client may take to accept the close frame when the server shuts down.
_CLOSE_TIMEOUT_S = 1.0


class Session:
    """``GET /v1/session``: the reads and waits of the API over one websocket, for clients
    that make many at once (the kafka:// and http:// clients). A text frame is a JSON array
    of calls ``{"id": n, "op": "status"|"history"|"result"|"finished"|"settled"|"cancel",
    ...}``; replies ``{"id": n, "ok": ...}`` or ``{"id": n, "error": {"type": ...,
    "message": ...}}`` come back batched, in whatever order the calls finish. Much cheaper
    per call than a request. On a Kafka worker a read (``status``, ``history``,
    ``result``) may name ``after`` and ``after_offset``, the command id of a start its
    client published and where the broker put it: it is answered once the owner has got
    past that start (an error if it refused it).

    What one client can hold: ``SESSION_MAX_CALLS`` calls running (a call over that, or
    with the id of a call still running, is answered with an error at once), frames of at
    most ``SESSION_FRAME_CALLS`` calls and the server's body limit in bytes (more closes
    the session), and no new frame is read while ``SESSION_FRAME_CALLS`` replies wait to
    be written (a client that does not read stops being served). So a session holds at
    most ``SESSION_MAX_CALLS`` running calls and about twice that many replies. Closing
    the session cancels its calls.

    What all of them can hold (``ops.api.limits``): ``limits.max_pending`` calls, each
    from when it is read until it ends (over that, ``ServerBusy`` at once); and a client
    that has not accepted a frame of replies within ``limits.write_timeout_s`` loses its
    session, and its calls with it. Big frames take turns (``SessionConnection._take``).
    """

    def __init__(
        self,
        transport: Transport,
        commands: CommandWaiter | None,
        max_body_bytes: int,
        limits: ApiLimits,
        pending: Pending,
    ) -> None:
        self._calls = SessionCalls(transport, commands)
        self._max = max_body_bytes
        self.limits = limits
        self.pending = pending
        self.gate = asyncio.Lock()  # whose turn it is to start calls (see SessionConnection._take)
        self._open: set[SessionConnection] = set()
        # What clients sent and got, over every session: calls by op (``SESSION_OPS``,
        # else ``OTHER_OP``), and text frames ``received`` and ``sent``.
        self.calls_by_op = dict.fromkeys((*SESSION_OPS, OTHER_OP), 0)
        self.frames = {"received": 0, "sent": 0}

    @property
    def calls_in_flight(self) -> int:
        """Calls running now, over every open session."""
        return sum(len(c.calls) for c in self._open)

    @property
    def sessions(self) -> int:
        return len(self._open)

    async def close_all(self, app: web.Application) -> None:
        """On shutdown: a session would otherwise keep the server waiting for it. All at
        once, and a client that does not take its close frame within a second is cut."""

        async def close(connection: SessionConnection) -> None:
            try:
                async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                    await connection.ws.close(
                        code=WSCloseCode.GOING_AWAY, message=b"server shutting down"
                    )
            except TimeoutError:
                connection.cut(f"it took no close frame within {_CLOSE_TIMEOUT_S:g} s")
            except asyncio.CancelledError:
                # aiohttp's writers share one drain future: the session's sender, blocked
                # on it and cancelled as the session ends, cancels this close's wait too.
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                connection.cut("it took no close frame")

        await asyncio.gather(*(close(c) for c in list(self._open)))

    async def serve(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=20.0, max_msg_size=self._max)
        await ws.prepare(request)
        connection = SessionConnection(self, ws, request)
        self._open.add(connection)
        try:
            await connection.serve()
        finally:
            self._open.discard(connection)
        return ws

    async def answer(self, call: dict[str, Any]) -> Any:
        """The reply to one call of any session (``SessionCalls.answer``)."""
        return await self._calls.answer(call)
