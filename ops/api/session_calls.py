"""What each call of an API session does (``ops.api.session``): its fields checked as
its HTTP route checks them, then answered through the transport.

A command (start, send_event, cancel_workflow, pause, resume) is answered once the
transport took it and joins the caller's trace; a read or wait (status, history, result,
reply, finished, settled) names its instance and may wait, on a Kafka worker, for the
owner to get past a start its client published (``after``, ``after_offset``).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Any, Protocol

from stepstream.engine.errors import InvalidPayload
from stepstream.engine.wire.settle import error_for, recorded_and_ignored
from stepstream.ops.api.fields import check_fields, queue_fields, string_field
from stepstream.producers import trace_context
from stepstream.producers.client import Transport
from stepstream.producers.queue_positions import with_queue_positions

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


def waits(call: dict[str, Any]) -> bool:
    """Whether ``call`` may last until something happens (it holds a place among the
    waits of ``Pending``)."""
    return call.get("op") in _WAITS or "after" in call or "after_offset" in call


class CommandWaiter(Protocol):
    """For clients that publish commands themselves (Kafka): may this instance take a
    command, and is the one published settled (``GET /v1/commands/{id}``)?"""

    def finished_status(self, instance_id: str) -> str | None:
        """The status of a finished instance, None if it is not finished; raises
        ``UnknownInstance`` if there is none."""
        ...

    async def wait_settled(
        self, command_id: str, instance_id: str, timeout: float | None
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


class SessionCalls:
    """The calls of every session of one API, over its transport; ``commands`` (Kafka
    workers only) answers ``finished``, ``settled`` and reads with ``after``."""

    def __init__(self, transport: Transport, commands: CommandWaiter | None) -> None:
        self._transport = transport
        self._commands = commands

    async def answer(self, call: dict[str, Any]) -> Any:
        """The reply to one call (its ``ok`` value); raises what the call failed with."""
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
        timeout = _timeout(call.get("timeout"))
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


def _timeout(raw: object) -> float | None:
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
