"""The API's ``/v1/session`` websocket: many calls of one client over one connection,
batched both ways (see ``producers.http.session`` for the client side).

A text frame is a JSON array of calls ``{"id": n, "op": ..., <arguments>}``; replies come
back as arrays of ``{"id": n, "ok": <value>}`` or ``{"id": n, "error": {...}}``, in any
order. Reads and waits (status, history, result, reply, finished, settled) and commands
(start, send_event, cancel_workflow, pause, resume) are calls; ``{"id": n, "op":
"cancel"}`` withdraws call n.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import socket
import struct
import time
import uuid
from typing import Any, Protocol

from aiohttp import WSCloseCode, web

from stepstream.engine.errors import InvalidPayload, StepstreamError
from stepstream.engine.wire.codec import parse_json_text
from stepstream.engine.wire.settle import error_for, recorded_and_ignored
from stepstream.ops.api.fields import check_fields, queue_fields, string_field
from stepstream.ops.api.limits import REFUSED_SESSION, ApiLimits, Pending, server_fault
from stepstream.producers import trace_context
from stepstream.producers.client import Transport
from stepstream.producers.http.wire import (
    SESSION_FRAME_BYTES,
    SESSION_FRAME_CALLS,
    SESSION_MAX_CALLS,
    error_to_wire,
)
from stepstream.producers.queue_positions import with_queue_positions

log = logging.getLogger("stepstream.api")

# Session calls that are commands (``cancel`` withdraws a call of the session itself),
# with their required and optional fields (those of their HTTP routes, and the instance).
_COMMANDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "start": (
        ("workflow",),
        ("input", "instance_id", "version", "if_exists", "priority", "queue_key"),
    ),
    "send_event": (("instance_id", "name"), ("payload", "event_id")),
    "cancel_workflow": (("instance_id",), ("reason",)),
    "pause": (("instance_id",), ()),
    "resume": (("instance_id",), ()),
}
# How long a client may take to accept the close frame when the server shuts down.
_CLOSE_TIMEOUT_S = 1.0
# Calls of one frame started before the session lets others have the event loop.
_CALLS_PER_TURN = 10
# Calls that last until something happens (or their timeout): see ``Pending``.
_WAITS = frozenset({"result", "reply", "settled"})
_TRACE_FIELDS = ("traceparent", "tracestate")
_CALL_FIELDS = frozenset({"id", "op", *_TRACE_FIELDS})
# The ops calls are counted by (``stepstream_api_session_calls_total{op}``); any other is
# ``other``, so a client cannot grow the label's values.
SESSION_OPS = (
    *_COMMANDS,
    "status",
    "history",
    "result",
    "reply",
    "finished",
    "settled",
    "cancel",
)
OTHER_OP = "other"


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

    async def wait_after(
        self, instance_id: str, command_id: str | None, offset: int | None, timeout: float | None
    ) -> str | None:
        """What became of a start a client published, once the owner got past it (see
        ``ops.worker_reads``)."""
        ...


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
    session, and its calls with it. Big frames take turns (``_Connection._take``).
    """

    def __init__(
        self,
        transport: Transport,
        commands: CommandWaiter | None,
        max_body_bytes: int,
        limits: ApiLimits,
        pending: Pending,
    ) -> None:
        self._transport = transport
        self._commands = commands
        self._max = max_body_bytes
        self.limits = limits
        self.pending = pending
        self.gate = asyncio.Lock()  # whose turn it is to start calls (see _Connection._take)
        self._open: set[_Connection] = set()
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

        async def close(connection: _Connection) -> None:
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
        connection = _Connection(self, ws, request)
        self._open.add(connection)
        try:
            await connection.serve()
        finally:
            self._open.discard(connection)
        return ws

    async def _call(self, call: dict[str, Any]) -> Any:
        op = call.get("op")
        if op in _COMMANDS:
            # A command joins the caller's trace as the HTTP routes do with headers; one
            # without trace fields is in no trace (not the websocket upgrade's, which may
            # have carried the trace of whatever opened the session).
            carrier = {k: v for k in _TRACE_FIELDS if isinstance(v := call.get(k), str)}
            with (
                trace_context.joined(carrier)
                if "traceparent" in carrier
                else trace_context.in_no_trace()
            ):
                return await self._command(str(op), call)
        instance_id = call.get("instance_id")
        if not isinstance(instance_id, str) or not instance_id:
            raise InvalidPayload(f"session call {op!r} needs a non-empty instance_id")
        timeout = _session_timeout(call.get("timeout"))
        if self._commands is not None and ("after" in call or "after_offset" in call):
            began = time.monotonic()
            await self._after(call.get("after"), call.get("after_offset"), instance_id, timeout)
            if timeout is not None:  # one timeout for the whole read
                timeout = max(0.0, timeout - (time.monotonic() - began))
        if op == "status":
            status = await self._transport.status(instance_id)
            return (await with_queue_positions(self._transport, status)).to_json()
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
            f"unknown session call {op!r}; known: status, history, result, reply, finished, "
            f"settled, {', '.join(_COMMANDS)}"
        )

    async def _after(
        self, command_id: object, offset: object, instance_id: str, timeout: float | None
    ) -> None:
        """A read with ``after`` (the command id of the client's start) and
        ``after_offset`` (where the broker put it): first wait until the owner has got
        that far (a ``kafka://`` start returns once the broker has it, before the owner
        has applied it). A start recorded and ignored (the instance existed) is no error
        to a read of the instance; a refused one is."""
        if command_id is not None and (not isinstance(command_id, str) or not command_id):
            raise InvalidPayload("session call field 'after' must be a command id")
        if offset is not None and (
            isinstance(offset, bool) or not isinstance(offset, int) or offset < 0
        ):
            raise InvalidPayload("session call field 'after_offset' must be an offset (int >= 0)")
        assert self._commands is not None
        reason = await self._commands.wait_after(instance_id, command_id, offset, timeout)
        if reason is not None and not recorded_and_ignored(reason):
            raise error_for(reason, instance_id, "start")

    async def _command(self, op: str, call: dict[str, Any]) -> dict[str, Any]:
        """The commands, checked as their HTTP routes check them; answered once the
        transport took the command (as ``POST /v1/instances`` and the others are). A
        command runs to its end even if the session goes away meanwhile, as a request's
        handler does: it is not left half published."""
        required, optional = _COMMANDS[op]
        check_fields(call.keys() - _CALL_FIELDS, required, optional, what=f"session call {op!r}")
        return await asyncio.shield(self._apply(op, call))

    async def _apply(self, op: str, call: dict[str, Any]) -> dict[str, Any]:
        transport = self._transport
        if op == "start":
            workflow = string_field(call, "workflow")
            given = call.get("instance_id")
            instance_id = string_field(call, "instance_id") if given is not None else ""
            version = string_field(call, "version") if call.get("version") is not None else None
            started = await transport.start(
                workflow,
                call.get("input"),
                instance_id or str(uuid.uuid4()),
                version,
                string_field(call, "if_exists") if "if_exists" in call else "return",
                **queue_fields(call),
            )
            return {"instance_id": started}
        instance_id = string_field(call, "instance_id")
        if op == "send_event":
            event_id = string_field(call, "event_id") if call.get("event_id") is not None else None
            name = string_field(call, "name")
            await transport.send_event(instance_id, name, call.get("payload"), event_id)
        elif op == "cancel_workflow":
            reason = string_field(call, "reason", allow_empty=True) if "reason" in call else ""
            await transport.cancel(instance_id, reason)
        elif op == "pause":
            await transport.pause(instance_id)
        else:
            await transport.resume(instance_id)
        return {}


class _Connection:
    """One client's session: its running calls and the replies waiting to be written.
    A call holds its place in the server's ``Pending`` from the moment it is read until
    it ends (answered, withdrawn, or cancelled with the session)."""

    def __init__(self, session: Session, ws: web.WebSocketResponse, request: web.Request) -> None:
        self.session = session
        self.ws = ws
        self._request = request
        self.calls: dict[int, asyncio.Task[None]] = {}
        self._replies: list[str] = []  # JSON texts to write
        self._ready = asyncio.Event()  # replies to write
        self._written = asyncio.Event()  # the replies were written

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        sender = loop.create_task(self._send())
        try:
            async for message in self.ws:
                if message.type != web.WSMsgType.TEXT:
                    continue
                self.session.frames["received"] += 1
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
            self._replies.clear()

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
        # A frame's first _CALLS_PER_TURN calls start at once; beyond them, sessions take
        # turns, that many calls at a time, and the calls started in one turn of the
        # event loop run before more are: a flood of big frames gets its share of the
        # loop, and a client's small frame never waits behind it.
        gate = self.session.gate
        held = False
        started = 0
        try:
            for call in batch:
                if started == _CALLS_PER_TURN:
                    await asyncio.sleep(0)  # this turn's calls run first
                    if held:
                        gate.release()
                        held = False
                    await gate.acquire()  # behind the sessions waiting for a turn
                    held = True
                    started = 0
                started += self._start(call)
        finally:
            if held:
                gate.release()
        return True

    def _start(self, call: object) -> bool:
        """Start one call of a frame; False if it was answered at once instead."""
        call_id = call.get("id") if isinstance(call, dict) else None
        if isinstance(call_id, bool) or not isinstance(call_id, int):
            self._refuse(None, "every session call needs an integer id")
            return False
        assert isinstance(call, dict)
        op = call.get("op")
        counted = self.session.calls_by_op
        counted[op if isinstance(op, str) and op in counted else OTHER_OP] += 1
        if op == "cancel":
            task = self.calls.pop(call_id, None)
            if task is not None:
                task.cancel()
            return False
        if call_id in self.calls:
            self._refuse(
                call_id,
                f"call id {call_id} is still in flight in this session; use a new id for each call",
            )
            return False
        if len(self.calls) >= SESSION_MAX_CALLS:
            self.session.pending.refused[REFUSED_SESSION] += 1
            self._refuse(
                call_id,
                f"this session has {SESSION_MAX_CALLS} calls in flight, the most it "
                "takes; wait for some to finish, or cancel them",
            )
            return False
        wait = call.get("op") in _WAITS or "after" in call or "after_offset" in call
        if not self.session.pending.take(wait=wait):
            self._queue({"id": call_id, **error_to_wire(self.session.pending.busy())})
            return False
        task = asyncio.get_running_loop().create_task(self._run(call_id, call))
        self.calls[call_id] = task
        task.add_done_callback(functools.partial(self._finished, call_id, wait))
        return True

    async def _run(self, call_id: int, call: dict[str, Any]) -> None:
        try:
            reply: dict[str, Any] = {"id": call_id, "ok": await self.session._call(call)}
        except Exception as exc:
            if (fault := server_fault(exc)) is not None:
                reply = {"id": call_id, **error_to_wire(fault)}
            elif isinstance(exc, StepstreamError):
                reply = {"id": call_id, **error_to_wire(exc)}
            else:
                log.exception("session call failed op=%s", call.get("op"))
                reply = {"id": call_id, **_internal_error()}
        self._done(call_id, asyncio.current_task())
        self._queue(reply)

    def _done(self, call_id: int, task: object) -> None:
        # Also on cancellation, which may come before the call ever ran.
        if self.calls.get(call_id) is task:
            del self.calls[call_id]

    def _finished(self, call_id: int, wait: bool, task: asyncio.Task[None]) -> None:
        # Run however the call ends, even cancelled before it ever ran: its place is free.
        self._done(call_id, task)
        self.session.pending.release(waits=int(wait))

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
        # up to about SESSION_FRAME_BYTES each. A client that does not take a frame within
        # the write timeout loses the session: it is not reading, and its replies would
        # hold their memory and their places in Pending for as long as it stays.
        ws, replies = self.ws, self._replies
        deadline = self.session.limits.write_timeout_s
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
                    try:
                        async with asyncio.timeout(deadline):
                            await ws.send_str(frame)
                        self.session.frames["sent"] += 1
                    except TimeoutError:
                        self.cut(f"it took no frame of replies within {deadline:g} s")
                        return
                self._written.set()
        finally:
            self._written.set()  # the reader must not wait for a sender that is gone

    def cut(self, why: str) -> None:
        """End a session whose client does not read: no close handshake (it would not
        be read either), the connection is cut and the session's calls cancelled."""
        log.warning(
            "cutting the session of %s: %s (a client that does not read); its %d calls "
            "are cancelled",
            self._request.remote,
            why,
            len(self.calls),
        )
        transport = self._request.transport
        if transport is not None:
            # A reset rather than a close: the kernel drops what it still holds for the
            # client instead of trickling it out to a reader that takes nothing.
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()


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
