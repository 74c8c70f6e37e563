"""``http://HOST:PORT``: the client transport that talks to the stepstream HTTP API (a
``stepstream dev`` process or the API service), and the wire form of errors that the API
and this transport share.

Errors cross the wire as ``{"error": {"type": "<ClassName>", "message": ..., <fields>}}``
and become the same ``engine.errors`` class again on this side, found by name in an
explicit allow-list: the server's words never choose which code runs here.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from engine.errors import (
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
from engine.views import HistoryEntry, InstanceStatus
from producers.client import Transport, register_transport

_WIRE_ERRORS: dict[str, type[StepstreamError]] = {
    cls.__name__: cls
    for cls in (
        StepstreamError,
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


class HttpTransport:
    """One ``aiohttp.ClientSession`` for every call; ``close()`` closes it."""

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

    async def start(self, workflow: str, input: Any, instance_id: str) -> str:
        body = {"workflow": workflow, "input": input, "instance_id": instance_id}
        data = _encode(body, f"input of workflow {workflow!r}")
        answer = await self._call("POST", "/v1/instances", data=data)
        return str(answer["instance_id"])

    async def send_event(self, instance_id: str, name: str, payload: Any) -> None:
        data = _encode(
            {"name": name, "payload": payload},
            f"payload of event {name!r} for instance {instance_id}",
        )
        await self._call("POST", f"{_path(instance_id)}/events", data=data)

    async def cancel(self, instance_id: str, reason: str) -> None:
        data = _encode({"reason": reason}, "cancel reason")
        await self._call("POST", f"{_path(instance_id)}/cancel", data=data)

    async def pause(self, instance_id: str) -> None:
        await self._call("POST", f"{_path(instance_id)}/pause")

    async def resume(self, instance_id: str) -> None:
        await self._call("POST", f"{_path(instance_id)}/resume")

    async def status(self, instance_id: str) -> InstanceStatus:
        return InstanceStatus.from_json(await self._call("GET", _path(instance_id)))

    async def result(self, instance_id: str, timeout: float | None) -> Any:
        # One long request: the server waits for the instance to finish (it is woken by
        # the commit, it does not poll) and answers at the latest after ``timeout``.
        params = {} if timeout is None else {"timeout": repr(float(timeout))}
        wait = None if timeout is None else timeout + _RESULT_MARGIN_S
        answer = await self._send("GET", f"{_path(instance_id)}/result", None, params, wait)
        return answer["result"]

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        answer = await self._call("GET", f"{_path(instance_id)}/history")
        return [HistoryEntry.from_json(raw) for raw in answer["history"]]

    async def list(self, status: str | None) -> list[InstanceStatus]:
        params = {} if status is None else {"status": status}
        answer = await self._call("GET", "/v1/instances", params=params)
        return [InstanceStatus.from_json(raw) for raw in answer["instances"]]

    async def close(self) -> None:
        await self._session.close()

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
        try:
            async with self._session.request(
                method,
                url,
                data=data,
                params=params,
                headers={"Content-Type": "application/json"} if data is not None else None,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                status = response.status
                raw = await response.read()
        except aiohttp.ClientConnectorError as exc:
            raise ConnectionFailed(
                f"cannot reach stepstream at {self._base}: is `stepstream dev` running? "
                f"({exc.os_error.strerror or exc}); start it, or pass --connect / "
                "STEPSTREAM_CONNECT with the right address"
            ) from None
        except aiohttp.ClientError as exc:
            raise ConnectionFailed(
                f"lost the connection to stepstream at {self._base} during {method} {path}: "
                f"{exc or type(exc).__name__}; check the server log, then retry"
            ) from None
        except TimeoutError:
            raise ConnectionFailed(
                f"stepstream at {self._base} did not answer {method} {path} within {timeout} s; "
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
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(
            f"{what} is not JSON-encodable ({exc}); pass only dict, list, str, int, "
            "float (finite), bool or None"
        ) from None


async def _connect(url: str, options: dict[str, Any]) -> Transport:
    request_timeout = float(options.pop("timeout", DEFAULT_REQUEST_TIMEOUT_S))
    if options:
        raise StepstreamError(
            f"unknown options for {url}: {', '.join(sorted(options))} (known: timeout)"
        )
    parsed = URL(url)
    if not parsed.host:
        raise StepstreamError(f"cannot connect to {url!r}: no host; use http://HOST:PORT")
    session = aiohttp.ClientSession(headers={"Accept": "application/json"})
    return HttpTransport(url, session, request_timeout=request_timeout)


register_transport("http", _connect)
register_transport("https", _connect)
