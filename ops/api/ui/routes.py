"""The web UI's routes: ``/ui`` (the page), ``/ui/static/*`` (its files) and
``/ui/api/*`` (the JSON it reads and the controls it sends).

The JSON goes through a ``Transport`` that covers the whole deployment: on
``stepstream dev`` the engine's own, on a Kafka worker a ``kafka://`` client of the
worker's cluster (opened on first use), so a worker's UI lists every worker's partitions
and controls instances wherever they run. The page and its files hold no data and are
served without a token; every ``/ui/api`` call needs the API's bearer token when one is
set (``ops.api.security``), which the page asks for and keeps for the browser tab.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from stepstream.engine.errors import InvalidPayload
from stepstream.engine.reads.listing import ListQuery
from stepstream.engine.reads.views import HistoryEntry
from stepstream.engine.wire.codec import parse_json_text
from stepstream.ops.api.fields import check_fields, string_field
from stepstream.ops.api.repair import REPAIRS, repair
from stepstream.ops.tools.timeline import timeline_rows
from stepstream.producers.client import Transport
from stepstream.producers.queue_positions import with_queue_positions

# Each control's (required, optional) body fields.
_CONTROL_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cancel": ((), ("reason",)),
    "terminate": ((), ("reason",)),
    "pause": ((), ()),
    "resume": ((), ()),
    "events": ((), ("name", "payload", "event_id")),
}

UI_PATHS = ("/ui", "/ui/")
STATIC_PREFIX = "/ui/static/"
TransportSource = Callable[[], Awaitable[Transport]]
_STATIC = resources.files("stepstream.ops.api.ui") / "static"
UI_FILES = frozenset(
    {
        "app.js",
        "api.js",
        "controls.js",
        "dom.js",
        "index.html",
        "instance.js",
        "pages.js",
        "parts.js",
        "repair.js",
        "schedules.js",
        "style.css",
        "theme.js",
        "timeline.js",
        "tree.js",
    }
)
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}


def add_ui_routes(
    app: web.Application,
    transport: TransportSource,
    registry_names: Callable[[], dict[str, list[str]]] | None,
) -> None:
    """Serve the UI on ``app``; its JSON reads and controls go through ``transport()``."""
    ui = _Ui(transport, registry_names)
    for path in UI_PATHS:
        app.router.add_get(path, ui.page)
    app.router.add_get(STATIC_PREFIX + "{name}", ui.static)
    app.router.add_get("/ui/api/instances", ui.instances)
    app.router.add_get("/ui/api/instances/{id}", ui.instance)
    app.router.add_post("/ui/api/instances/{id}/{control}", ui.control)
    app.router.add_get("/ui/api/definitions", ui.definitions)


class _Ui:
    def __init__(
        self,
        transport: TransportSource,
        registry_names: Callable[[], dict[str, list[str]]] | None,
    ) -> None:
        self._transport = transport
        self._registry_names = registry_names

    async def page(self, request: web.Request) -> web.StreamResponse:
        response = _file("index.html")
        # Only this server's own files run in the page, and no other site may frame it
        # (its buttons cancel workflows).
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"
        )
        response.headers["X-Frame-Options"] = "DENY"
        return response

    async def static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in UI_FILES:
            raise web.HTTPNotFound()
        return _file(name)

    async def instances(self, request: web.Request) -> web.Response:
        page = await (await self._transport()).list_page(ListQuery.from_params(request.query))
        return web.json_response(page.to_json())

    async def instance(self, request: web.Request) -> web.Response:
        transport = await self._transport()
        instance_id = request.match_info["id"]
        status, history = await asyncio.gather(
            transport.status(instance_id), transport.history(instance_id)
        )
        status = await with_queue_positions(transport, status)
        return web.json_response(
            {
                "status": status.to_json(),
                **_input_and_result(history),
                "timeline": [row.to_json() for row in timeline_rows(history)],
                "history": [entry.to_json() for entry in history],
            }
        )

    async def control(self, request: web.Request) -> web.Response:
        transport = await self._transport()
        instance_id, control = request.match_info["id"], request.match_info["control"]
        text = await request.text()
        body = parse_json_text(text, what="request body") if text.strip() else {}
        if not isinstance(body, dict):
            raise InvalidPayload("the request body must be a JSON object")
        if control in REPAIRS:
            answer = await repair(transport, instance_id, control, body)
            return web.json_response(answer, status=202)
        # The same fields as the /v1 call of that name: a misspelled one is refused.
        fields = _CONTROL_FIELDS.get(control)
        if fields is None:
            raise web.HTTPNotFound()
        check_fields(body.keys(), *fields, what="request body")
        reason = string_field(body, "reason", allow_empty=True) if "reason" in body else ""
        if control == "cancel":
            await transport.cancel(instance_id, reason)
        elif control == "terminate":
            await transport.terminate(instance_id, reason)
        elif control == "pause":
            await transport.pause(instance_id)
        elif control == "resume":
            await transport.resume(instance_id)
        else:
            name = body.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidPayload("give the event a name (the one the workflow waits for)")
            event_id = string_field(body, "event_id") if body.get("event_id") is not None else None
            await transport.send_event(instance_id, name, body.get("payload"), event_id)
        return web.json_response({"ok": True}, status=202)

    async def definitions(self, request: web.Request) -> web.Response:
        names = self._registry_names() if self._registry_names is not None else {}
        overview = await (await self._transport()).overview()
        return web.json_response({"workflows": names, "overview": overview.to_json()})


def _input_and_result(history: list[HistoryEntry]) -> dict[str, Any]:
    """The input and result as recorded (decoded by the codec), from the history."""
    out: dict[str, Any] = {}
    for entry in history:
        if entry.type == "WorkflowStarted":
            out["input"] = entry.attributes.get("input")
        elif entry.type == "WorkflowCompleted":
            out["result"] = entry.attributes.get("result")
    return out


def _file(name: str) -> web.Response:
    body = (_STATIC / name).read_bytes()
    content_type = _TYPES[name[name.rindex(".") :]]
    # Small files, and a new version must show at once after an upgrade.
    return web.Response(
        body=body,
        content_type=content_type,
        charset="utf-8",
        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"},
    )
