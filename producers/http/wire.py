"""The wire form of the HTTP API, the one module its server (``ops.api``) and its
clients (this package) both speak: the error body, the ``/v1/session`` websocket's
frames and limits, and the paths both sides name.

Errors cross the wire as ``{"error": {"type": "<ClassName>", "message": ..., <fields>}}``
and become the same ``engine.errors`` class again on the client side, found by name in
an explicit allow-list: the server's words never choose which code runs there.

A session frame is a JSON array of calls ``{"id": n, "op": ..., <arguments>}``; replies
come back as arrays of ``{"id": n, "ok": <value>}`` or ``{"id": n, "error": {...}}``.
"""

from __future__ import annotations

import json
from typing import Any

from stepstream.engine.errors import (
    AccessDenied,
    ConnectionFailed,
    HistoryDiverged,
    InstanceExists,
    InstanceFinished,
    InstanceNotFailed,
    InstanceNotPaused,
    InvalidPayload,
    PayloadTooLarge,
    ResultTimeout,
    StepstreamError,
    UndecodableRecord,
    UnknownInstance,
    UnknownReplayKey,
    UnknownWorkflow,
    WorkflowCancelled,
    WorkflowFailed,
    WorkflowTerminated,
    WorkflowTimeout,
)


class ServerUnavailable(StepstreamError):
    """The API cannot take the call now, through no fault of the call (HTTP 503 with
    ``Retry-After``; the same error over the session): its storage failed (a full disk),
    or it is at its limit of pending calls (``ServerBusy``). Make the same call again
    after ``retry_after`` seconds, on this server once it is back or on another."""

    retriable = True

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ServerBusy(ServerUnavailable):
    """The API holds as many pending calls and waits as it takes (``--max-pending``,
    ``STEPSTREAM_MAX_PENDING``, over every client): retry after ``retry_after`` seconds,
    wait for fewer things at once, or raise the server's limit."""


class ConnectionLost(ConnectionFailed):
    """The connection broke after the call was sent, before its answer came. A command
    may have been applied (``status`` or ``history`` tells): not ``retriable``. The
    ``http://`` client asks a wait (``result``, a reply) or a read again by itself; one
    that still fails is ``retriable``."""

    retriable = False


_WIRE_ERRORS: dict[str, type[StepstreamError]] = {
    cls.__name__: cls
    for cls in (
        StepstreamError,
        AccessDenied,
        UnknownWorkflow,
        InvalidPayload,
        PayloadTooLarge,
        UnknownInstance,
        InstanceExists,
        InstanceFinished,
        InstanceNotPaused,
        UnknownReplayKey,
        InstanceNotFailed,
        WorkflowFailed,
        WorkflowTimeout,
        WorkflowCancelled,
        WorkflowTerminated,
        ResultTimeout,
        ConnectionFailed,
        ConnectionLost,
        UndecodableRecord,
        HistoryDiverged,
        ServerUnavailable,
        ServerBusy,
    )
}
# Keyword fields an error carries besides its message, sent along so that the client
# rebuilds the same exception (``WorkflowFailed.error_type`` and so on).
_ERROR_FIELDS: dict[type[StepstreamError], tuple[str, ...]] = {
    WorkflowFailed: ("instance_id", "error_type"),
    WorkflowTimeout: ("instance_id", "error_type"),
    WorkflowCancelled: ("instance_id", "reason"),
    WorkflowTerminated: ("instance_id", "reason"),
    InstanceExists: ("instance_id", "status"),
    HistoryDiverged: ("key",),
    ServerUnavailable: ("retry_after",),
    ServerBusy: ("retry_after",),
}

# The session websocket: calls one session may have in flight (the server answers more
# with an error), calls per frame (a bigger frame closes the session) and the size a
# frame's text stays under (a bigger one closes it too).
SESSION_PATH = "/v1/session"
SESSION_MAX_CALLS = 10_000
SESSION_FRAME_CALLS = 1_000
SESSION_FRAME_BYTES = 1024 * 1024
# A command whose JSON is bigger goes as a request of its own, not on the session.
SESSION_COMMAND_BYTES = 64 * 1024

# Where a server of several engine processes says which process serves which partitions
# (``ops.processes``; read by ``producers.http.routing``).
PROCESSES_PATH = "/v1/processes"


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
    if issubclass(cls, ServerUnavailable):
        return cls(message, retry_after=retry_after_of(raw.get("retry_after")))
    fields = {name: str(raw.get(name, "")) for name in _ERROR_FIELDS.get(cls, ())}
    return cls(message, **fields)


def retry_after_of(raw: object, default: float = 1.0) -> float:
    """A ``retry_after`` field or ``Retry-After`` header in seconds (``default`` if it
    is missing or not a number of seconds: an HTTP date is not worth a parser here)."""
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        return default
    try:
        value = float(raw)
    except ValueError:
        return default
    return value if 0 <= value < 86400 else default


def call_text(call_id: int, op: str, args: str) -> str:
    """A session call's JSON text: ``args`` (a JSON object's text) with its id and op."""
    head = f'{{"id":{call_id},"op":{json.dumps(op)}'
    return head + "}" if args == "{}" else head + "," + args[1:]
