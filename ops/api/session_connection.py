"""One client's session websocket (``ops.api.session``): its frames read and checked,
its calls started and counted within the session's and the server's limits, and its
replies batched into frames and written, or the session cut when its client does not
read them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import struct
from typing import TYPE_CHECKING, Any

from aiohttp import WSCloseCode, web

from stepstream.engine.errors import InvalidPayload, StepstreamError
from stepstream.engine.wire.codec import parse_json_text
from stepstream.ops.api.limits import REFUSED_SESSION, server_fault
from stepstream.ops.api.session_calls import OTHER_OP, waits
from stepstream.producers.http.wire import (
    SESSION_FRAME_BYTES,
    SESSION_FRAME_CALLS,
    SESSION_MAX_CALLS,
    error_to_wire,
)

if TYPE_CHECKING:
    from stepstream.ops.api.session import Session

log = logging.getLogger("stepstream.api")

# Calls of one frame started before the session lets others have the event loop.
_CALLS_PER_TURN = 10


class SessionConnection:
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
        wait = waits(call)
        if not self.session.pending.take(wait=wait):
            self._queue({"id": call_id, **error_to_wire(self.session.pending.busy())})
            return False
        task = asyncio.get_running_loop().create_task(self._run(call_id, call))
        self.calls[call_id] = task
        task.add_done_callback(functools.partial(self._finished, call_id, wait))
        return True

    async def _run(self, call_id: int, call: dict[str, Any]) -> None:
        try:
            reply: dict[str, Any] = {"id": call_id, "ok": await self.session.answer(call)}
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


def _internal_error() -> dict[str, Any]:
    message = "internal error; the traceback is in the server log"
    return {"error": {"type": "InternalError", "message": message}}


def _close_reason(exc: Exception) -> bytes:
    # A close frame's reason is at most 123 bytes.
    return str(exc).encode()[:120]
