"""The HTTP routes that take an instance back to an earlier point of its history:
``POST /v1/instances/{id}/reset`` (``{"to": KEY, "reason": R}``), ``.../retry``
(``{"reason": R}``) and ``.../fork`` (``{"to": KEY, "instance_id": NEW}``, answered with
the new instance's id). Each returns once the command is durable and its owner took it
(or refused it: ``UnknownReplayKey``, ``InstanceNotFailed``)."""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from stepstream.engine.errors import InvalidPayload
from stepstream.engine.wire.codec import parse_json_text
from stepstream.ops.api.fields import check_fields, string_field
from stepstream.producers.client import Transport, fork_instance


def add_repair_routes(app: web.Application, transport: Transport) -> None:
    routes = _Repair(transport)
    app.router.add_post("/v1/instances/{id}/reset", routes.reset)
    app.router.add_post("/v1/instances/{id}/retry", routes.retry)
    app.router.add_post("/v1/instances/{id}/fork", routes.fork)


class _Repair:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    async def reset(self, request: web.Request) -> web.Response:
        body = await _body(request, required=("to",), optional=("reason",))
        instance_id = request.match_info["id"]
        await self._transport.reset(instance_id, string_field(body, "to"), _reason(body))
        return web.json_response({"instance_id": instance_id, "reset_to": body["to"]}, status=202)

    async def retry(self, request: web.Request) -> web.Response:
        body = await _body(request, optional=("reason",))
        instance_id = request.match_info["id"]
        await self._transport.retry(instance_id, _reason(body))
        return web.json_response({"instance_id": instance_id, "retried": True}, status=202)

    async def fork(self, request: web.Request) -> web.Response:
        body = await _body(request, required=("to",), optional=("instance_id",))
        source = request.match_info["id"]
        new_id = (
            string_field(body, "instance_id")
            if body.get("instance_id") is not None
            else f"{source}-fork-{uuid.uuid4().hex[:8]}"
        )
        forked = await fork_instance(self._transport, source, string_field(body, "to"), new_id)
        return web.json_response({"instance_id": forked, "forked_from": source}, status=201)


# The web UI's controls of the same name (``ops.api.ui.routes``).
REPAIRS = ("reset", "retry", "fork")


async def repair(
    transport: Transport, instance_id: str, control: str, body: dict[str, Any]
) -> dict[str, Any]:
    """Apply one of ``REPAIRS`` for the web UI, with its JSON body; what it answers."""
    check_fields(body.keys(), (), ("to", "reason", "instance_id"), what="request body")
    if control == "retry":
        await transport.retry(instance_id, _reason(body))
        return {"instance_id": instance_id, "retried": True}
    to = string_field(body, "to")
    if control == "reset":
        await transport.reset(instance_id, to, _reason(body))
        return {"instance_id": instance_id, "reset_to": to}
    new_id = (
        string_field(body, "instance_id")
        if body.get("instance_id") is not None
        else f"{instance_id}-fork-{uuid.uuid4().hex[:8]}"
    )
    forked = await fork_instance(transport, instance_id, to, new_id)
    return {"instance_id": forked, "forked_from": instance_id}


def _reason(body: dict[str, Any]) -> str:
    return string_field(body, "reason", allow_empty=True) if "reason" in body else ""


async def _body(
    request: web.Request, *, required: tuple[str, ...] = (), optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    raw = await request.read()
    body: Any = {}
    if raw.strip():
        try:
            body = parse_json_text(raw.decode("utf-8"), what="request body")
        except UnicodeDecodeError:
            raise InvalidPayload("request body is not valid JSON: it is not UTF-8 text") from None
    if not isinstance(body, dict):
        raise InvalidPayload(f"request body must be a JSON object, not {type(body).__name__}")
    check_fields(body.keys(), required, optional, what="request body")
    return body
