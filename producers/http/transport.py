"""``HttpTransport``: a ``Transport`` over one stepstream HTTP API (a ``stepstream dev``
process, the API service, a Kafka worker's API).

Commands and short reads are requests on a pool of connections; waits (``result``,
``reply``) are calls on one websocket session (``producers.http.session``), so any
number of waits never starves the pool. Commands go on the session too (many share a
frame), unless they are big or the server does not take them there.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from stepstream.engine.errors import ConnectionFailed, InvalidPayload, StepstreamError
from stepstream.engine.reads.listing import InstancePage, ListQuery, Overview
from stepstream.engine.reads.views import HistoryEntry, InstanceStatus
from stepstream.engine.wire.codec import dump_json_text
from stepstream.producers import trace_context
from stepstream.producers.http.security import tls_failed, untrusted
from stepstream.producers.http.session import ApiSession, NotListening, SessionUnavailable
from stepstream.producers.http.wire import SESSION_COMMAND_BYTES, ConnectionLost, error_from_wire

log = logging.getLogger("stepstream.client")

# How much longer than the server-side wait a result request may take before the client
# gives up on the server itself.
_RESULT_MARGIN_S = 10.0
DEFAULT_REQUEST_TIMEOUT_S = 30.0
POOL_CONNECTIONS = 100  # the pool for commands and reads (waits use the session instead)
# Bodies over this are streamed (aiohttp's own limit for bytes, TOO_LARGE_BYTES_BODY).
_STREAMED_BODY_BYTES = 1 << 20
# A wait or a read whose connection is lost under it is asked again, up to
# ``HttpTransport.LOST_RETRIES`` times (refused connections included, once one was lost:
# 7.5 s for a server to be started again), after _LOST_DELAY_S, then twice as long.
_LOST_DELAY_S = 0.5
# Once an attempt ran this long, a loss is a new one: the tries start over. One dropped
# sooner than _DROPPED_AT_ONCE_S after a loss is not a server starting again.
_RAN_WELL_S = 10.0
_DROPPED_AT_ONCE_S = 1.0
_MAY_HAVE_BEEN = (
    "it may have been applied or not: `stepstream status` or `history` tells, and the "
    "server log says why the connection broke"
)
_ASK_AGAIN = (
    "check the server log, then retry (a server that serves https, --tls-cert, wants "
    "https:// in the address)"
)


class HttpTransport:
    """One ``aiohttp.ClientSession`` for every request and one ``ApiSession`` for the
    waits; ``close()`` closes both."""

    # What to do when nothing listens at the address (``stepstream dev`` is what an
    # http:// client usually talks to).
    NOT_LISTENING_ADVICE = (
        "is `stepstream dev` running? ({reason}); start it, or pass --connect / "
        "STEPSTREAM_CONNECT with the right address"
    )
    LOST_RETRIES = 4

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
        self.closed = False  # close() was called: a call it cuts off is not asked again
        # Commands go on the session unless the server turned out not to take them there.
        self._session_commands = True
        # Requests take the pool's connections in the order they were made. aiohttp
        # hands a freed connection to whichever request asks next, so under a steady
        # load of more than POOL_CONNECTIONS requests the ones already waiting could starve
        # until their timeout (measured: 400 of 500 concurrent starts failed after 30 s
        # while the other 100 went on); asyncio's semaphore is first come, first served.
        self._slots = asyncio.Semaphore(POOL_CONNECTIONS)

    # Commands go as calls on the session (many share a frame: the server parses one
    # frame, not one request, for each of them); a big one goes as its own request.
    async def start(
        self,
        workflow: str,
        input: Any,
        instance_id: str,
        version: str | None = None,
        if_exists: str = "return",
        *,
        priority: int | None = None,
        queue_key: str | None = None,
    ) -> str:
        body = {"workflow": workflow, "input": input, "instance_id": instance_id}
        if version is not None:
            body["version"] = version
        if if_exists != "return":
            body["if_exists"] = if_exists
        if priority is not None:
            body["priority"] = priority
        if queue_key is not None:
            body["queue_key"] = queue_key
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

    async def terminate(self, instance_id: str, reason: str) -> None:
        data = _encode({"reason": reason}, "terminate reason")
        # A request, not a session call: a server that predates it answers 404.
        await self._call("POST", f"{_path(instance_id)}/terminate", data=data)

    async def pause(self, instance_id: str) -> None:
        await self._command("pause", b"{}", f"{_path(instance_id)}/pause", instance_id)

    async def resume(self, instance_id: str) -> None:
        await self._command("resume", b"{}", f"{_path(instance_id)}/resume", instance_id)

    async def reset(self, instance_id: str, to: str, reason: str) -> None:
        data = _encode({"to": to, "reason": reason}, "reset")
        await self._call("POST", f"{_path(instance_id)}/reset", data=data)

    async def retry(self, instance_id: str, reason: str) -> None:
        data = _encode({"reason": reason}, "retry")
        await self._call("POST", f"{_path(instance_id)}/retry", data=data)

    async def fork(self, instance_id: str, to: str, new_id: str) -> str:
        data = _encode({"to": to, "instance_id": new_id}, "fork")
        answer = await self._call("POST", f"{_path(instance_id)}/fork", data=data)
        return str(answer["instance_id"])

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
        except ConnectionLost as exc:
            raise ConnectionLost(f"{exc} during {op}; {_MAY_HAVE_BEEN}") from None
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
        return await self._wait("result", timeout, f"the wait for {instance_id}", instance_id)

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any:
        # Like result(): a call on the session, answered when the answer is durable.
        what = f"the wait for a reply of {instance_id}"
        return await self._wait("reply", timeout, what, instance_id, message_id=message_id)

    async def _wait(
        self, op: str, timeout: float | None, what: str, instance_id: str, **args: Any
    ) -> Any:
        """A wait on the session, asked again when the connection is lost under it (the
        server restarted, or a `dev --processes` engine process was started again), until
        ``timeout`` has passed in all."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        tries = _Tries(self, what, deadline)
        left = timeout  # as given the first time: the server's ResultTimeout names it
        while True:
            limit = None if left is None else left + _RESULT_MARGIN_S
            try:
                async with asyncio.timeout(limit):
                    return await self._calls.call(op, instance_id=instance_id, timeout=left, **args)
            except (ConnectionLost, NotListening) as exc:
                await tries.again(exc)
                if deadline is not None:
                    left = round(max(0.0, deadline - loop.time()), 3)
            except TimeoutError as exc:
                if isinstance(exc, StepstreamError):
                    raise
                raise ConnectionFailed(
                    f"stepstream at {self._base} did not answer {what} within {limit} s; "
                    "check the server log, then retry"
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
        self.closed = True
        await self._calls.close()
        await self._session.close()

    async def close_session_only(self) -> None:
        """Close the websocket session, not the connection pool (another owns it)."""
        self.closed = True
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
        """A request; a read (GET) whose connection is lost under it is made again."""
        tries = _Tries(self, f"{method} {path}", None) if method == "GET" else None
        while True:
            try:
                return await self._send(method, path, data, params, self._request_timeout)
            except (ConnectionLost, NotListening) as exc:
                if tries is None:
                    raise
                await tries.again(exc)

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
            raise tls_failed(self._base, exc) from None
        except aiohttp.ClientConnectorError as exc:
            advice = self.NOT_LISTENING_ADVICE.format(reason=exc.os_error.strerror or exc)
            raise NotListening(f"cannot reach stepstream at {self._base}: {advice}") from None
        except aiohttp.ClientError as exc:
            lost = ConnectionLost(
                f"lost the connection to stepstream at {self._base} during {method} {path}: "
                f"{str(exc) or type(exc).__name__}; "
                + (_ASK_AGAIN if method == "GET" else _MAY_HAVE_BEEN)
            )
            lost.retriable = method == "GET"
            raise lost from None
        except TimeoutError:
            raise ConnectionFailed(
                f"stepstream at {self._base} did not answer {method} {path} within {timeout} s "
                f"(counting any wait for one of this client's {POOL_CONNECTIONS} connections); "
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


def _path(instance_id: str) -> str:
    return f"/v1/instances/{quote(instance_id, safe='')}"


def _encode(body: dict[str, Any], what: str) -> bytes:
    """Check the user's value here, before anything is sent."""
    return dump_json_text(body, what=what).encode()


class _Tries:
    """When to ask a read or a wait again whose connection broke under it: after a
    growing delay, up to ``LOST_RETRIES`` times and within ``deadline``; a refusal counts
    only once a connection was lost (a server being started again), and a connection
    dropped at once after a loss ends it (something there takes connections and drops
    them: the wrong scheme, say). Not after the transport was closed on purpose."""

    def __init__(self, transport: HttpTransport, what: str, deadline: float | None) -> None:
        self._transport = transport
        self._what = what
        self._deadline = deadline
        self._count = 0
        self._last: Exception | None = None
        self._began = asyncio.get_running_loop().time()

    async def again(self, exc: ConnectionLost | NotListening) -> None:
        """Returns once it is time to ask again; raises ``exc`` when it is not."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        ran = now - self._began
        if ran >= _RAN_WELL_S:
            self._count, self._last = 0, None  # it was answering: a new loss
        self._count += 1
        dropped_again = isinstance(self._last, ConnectionLost) and ran < _DROPPED_AT_ONCE_S
        if (
            self._transport.closed
            or self._count > self._transport.LOST_RETRIES
            or (isinstance(exc, NotListening) and self._last is None)
            or (isinstance(exc, ConnectionLost) and dropped_again)
            or (self._deadline is not None and now >= self._deadline)
        ):
            if isinstance(exc, ConnectionLost):
                exc.retriable = True  # a read or a wait: asking again later is safe
            raise exc
        self._last = exc
        delay = _LOST_DELAY_S * 2 ** (self._count - 1)
        if self._deadline is not None:
            delay = min(delay, self._deadline - now)
        log.info(
            "lost the connection to %s during %s (%s); asking again in %.2g s",
            self._transport.base_url,
            self._what,
            exc,
            delay,
        )
        await asyncio.sleep(delay)
        self._began = loop.time()
