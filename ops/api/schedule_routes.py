"""Schedules over HTTP: ``/v1/schedules`` for API users and ``/ui/api/schedules`` for the
web UI's Schedules page, both over the ``Client`` schedule calls.

- ``GET  <root>``: every schedule (``{"schedules": [...]}``)
- ``POST <root>``: create one, body ``{"name", "workflow", "cron" | "every", "input",
  "timezone", "overlap", "catchup_window"}`` (201, the schedule)
- ``GET  <root>/{name}``: one schedule (404 ``UnknownInstance`` if there is none)
- ``POST <root>/{name}/pause|resume|trigger|delete`` (202), and ``DELETE <root>/{name}``
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from stepstream.engine.api.schedule_spec import DEFAULT_CATCHUP_WINDOW
from stepstream.engine.errors import InvalidPayload
from stepstream.engine.wire.codec import parse_json_text
from stepstream.producers.client import Client, Transport

TransportSource = Callable[[], Awaitable[Transport]]
API_ROOT = "/v1/schedules"
UI_ROOT = "/ui/api/schedules"
_CONTROLS = ("pause", "resume", "trigger", "delete")
_FIELDS = {
    "name": str,
    "workflow": str,
    "cron": str,
    "every": int,
    "input": object,
    "timezone": str,
    "overlap": str,
    "catchup_window": int,
}


def add_schedule_routes(app: web.Application, root: str, transport: TransportSource) -> None:
    """Serve the schedule calls under ``root`` over the transport ``transport()`` gives."""
    routes = _ScheduleRoutes(transport)
    app.router.add_get(root, routes.list)
    app.router.add_post(root, routes.create)
    app.router.add_get(root + "/{name}", routes.describe)
    app.router.add_delete(root + "/{name}", routes.delete)
    app.router.add_post(root + "/{name}/{control}", routes.control)


class _ScheduleRoutes:
    def __init__(self, transport: TransportSource) -> None:
        self._transport = transport

    async def _client(self) -> Client:
        # A Client over the server's transport: closing it is the server's business.
        return Client(await self._transport())

    async def list(self, request: web.Request) -> web.Response:
        found = await (await self._client()).list_schedules()
        return web.json_response({"schedules": [s.to_json() for s in found]})

    async def create(self, request: web.Request) -> web.Response:
        body = await _body(request)
        info = await (await self._client()).create_schedule(
            body["name"],
            body["workflow"],
            cron=body.get("cron"),
            every=body.get("every"),
            input=body.get("input"),
            timezone=body.get("timezone", "UTC"),
            overlap=body.get("overlap", "skip"),
            catchup_window=body.get("catchup_window", DEFAULT_CATCHUP_WINDOW),
        )
        return web.json_response(info.to_json(), status=201)

    async def describe(self, request: web.Request) -> web.Response:
        info = await (await self._client()).describe_schedule(request.match_info["name"])
        return web.json_response(info.to_json())

    async def delete(self, request: web.Request) -> web.Response:
        await (await self._client()).delete_schedule(request.match_info["name"])
        return web.json_response({"ok": True}, status=202)

    async def control(self, request: web.Request) -> web.Response:
        control = request.match_info["control"]
        if control not in _CONTROLS:
            raise web.HTTPNotFound()
        client = await self._client()
        await getattr(client, f"{control}_schedule")(request.match_info["name"])
        return web.json_response({"ok": True}, status=202)


async def _body(request: web.Request) -> dict[str, Any]:
    text = await request.text()
    body = parse_json_text(text, what="request body") if text.strip() else {}
    if not isinstance(body, dict):
        raise InvalidPayload("the request body must be a JSON object")
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise InvalidPayload(
            f"unknown field(s) {', '.join(unknown)} in a schedule; known: {', '.join(_FIELDS)}"
        )
    for field in ("name", "workflow"):
        if not isinstance(body.get(field), str):
            raise InvalidPayload(f"a schedule needs {field!r} (a string)")
    for field, kind in _FIELDS.items():
        value = body.get(field)
        if value is None or kind is object:
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            raise InvalidPayload(f"schedule field {field!r} must be a {kind.__name__}")
    return body
