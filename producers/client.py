"""``Client``: start workflows, send events, control and query instances.

One client API over several transports, chosen by the connect string:
``embedded:PATH`` (in-process engine), ``http://HOST:PORT`` (a ``stepstream dev`` or API
service) and ``kafka://HOST:PORT?prefix=P``. Transports register themselves by scheme, so
this module depends on none of them.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from stepstream.engine.errors import StepstreamError
from stepstream.engine.reads.listing import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    InstancePage,
    ListQuery,
    Overview,
)
from stepstream.engine.reads.views import HistoryEntry, InstanceStatus
from stepstream.engine.wire.names import (
    check_if_exists,
    check_name,
    event_id_problem,
    event_name_problem,
)

DEFAULT_CONNECT = "http://127.0.0.1:8233"


class Transport(Protocol):
    async def start(
        self,
        workflow: str,
        input: Any,
        instance_id: str,
        version: str | None,
        if_exists: str = "return",
    ) -> str: ...

    async def send_event(
        self, instance_id: str, name: str, payload: Any, event_id: str | None = None
    ) -> None: ...

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any: ...

    async def cancel(self, instance_id: str, reason: str) -> None: ...

    async def terminate(self, instance_id: str, reason: str) -> None: ...

    async def pause(self, instance_id: str) -> None: ...

    async def resume(self, instance_id: str) -> None: ...

    async def status(self, instance_id: str) -> InstanceStatus: ...

    async def result(self, instance_id: str, timeout: float | None) -> Any: ...

    async def history(self, instance_id: str) -> list[HistoryEntry]: ...

    async def list(self, status: str | None) -> list[InstanceStatus]: ...

    async def list_page(self, query: ListQuery) -> InstancePage: ...

    async def overview(self) -> Overview: ...

    async def close(self) -> None: ...


TransportFactory = Callable[[str, dict[str, Any]], Awaitable[Transport]]
_TRANSPORTS: dict[str, TransportFactory] = {}
# Transports of this package, imported on first use (embedded registers from ops).
_BUILT_IN = {
    "http": "stepstream.producers.http",
    "https": "stepstream.producers.http",
    "kafka": "stepstream.producers.kafka",
}


def register_transport(scheme: str, factory: TransportFactory) -> None:
    _TRANSPORTS[scheme] = factory


class Client:
    """Use ``await Client.connect(url)`` (or ``async with Client.connect(url) as c``)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    @classmethod
    def connect(cls, url: str = DEFAULT_CONNECT, **options: Any) -> _Connecting:
        scheme = url.split(":", 1)[0]
        if scheme not in _TRANSPORTS and scheme in _BUILT_IN:
            importlib.import_module(_BUILT_IN[scheme])  # registers itself
        factory = _TRANSPORTS.get(scheme)
        if factory is None:
            known = ", ".join(sorted(f"{s}:" for s in _TRANSPORTS)) or "none"
            raise StepstreamError(
                f"cannot connect to {url!r}: unknown scheme {scheme!r} (known: {known}); "
                "use embedded:PATH, http://HOST:PORT or kafka://HOST:PORT?prefix=P"
            )
        return _Connecting(factory(url, options))

    async def start(
        self,
        workflow: str,
        input: Any = None,
        *,
        instance_id: str | None = None,
        version: str | None = None,
        if_exists: str = "return",
    ) -> str:
        """Start an instance and return its id. Idempotent on ``instance_id``: starting an
        id that exists returns it and leaves the existing instance as it is.

        ``if_exists`` says what a start of an existing id does, decided by the owner of
        the instance against the state it owns (so two clients never race): "return"
        (the default: the first run stands), "fail" (raises ``InstanceExists`` naming the
        id and its status), or "restart_if_failed" (an instance that failed, was
        cancelled or terminated starts afresh as its next run, its earlier runs kept in
        its history; a running or completed one is returned as with "return").

        The instance runs the latest version of ``workflow`` that the workers have, or
        ``version`` if given (one that is still deployed; ``UnknownWorkflow`` names the
        versions there are)."""
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        check_name(workflow, "workflow name")
        check_name(instance_id, "instance id")
        if version is not None:
            check_name(version, f"version of workflow {workflow!r}:")
        check_if_exists(if_exists)
        return await self._transport.start(workflow, input, instance_id, version, if_exists)

    async def send_event(
        self, instance_id: str, name: str, payload: Any = None, *, event_id: str | None = None
    ) -> None:
        """Send event ``name`` to the instance (buffered if nothing waits for it yet).
        ``event_id`` makes a retried send apply once (any id without ``:``)."""
        check_name(name, "event name", event_name_problem)
        if event_id is not None:
            check_name(event_id, "event id", event_id_problem)
        await self._transport.send_event(_id(instance_id), name, payload, event_id)

    async def request(
        self, instance_id: str, name: str, payload: Any = None, *, timeout: float | None = 60.0
    ) -> Any:
        """Send message ``name`` and wait for the workflow's answer to it
        (``await msg.complete(value)`` returns ``value`` here); ``ResultTimeout`` if
        there is none within ``timeout`` seconds (the message stays queued)."""
        check_name(name, "message name", event_name_problem)
        message_id = str(uuid.uuid4())
        await self._transport.send_event(_id(instance_id), name, payload, message_id)
        return await self._transport.reply(instance_id, message_id, timeout)

    async def cancel(self, instance_id: str, *, reason: str = "") -> None:
        await self._transport.cancel(_id(instance_id), reason)

    async def terminate(self, instance_id: str, *, reason: str = "") -> None:
        """End the instance at once with status ``terminated``: no compensation runs and
        running step attempts are given up, not awaited; the children it still waits for
        are terminated too. ``InstanceFinished`` if it had already finished."""
        await self._transport.terminate(_id(instance_id), reason)

    async def pause(self, instance_id: str) -> None:
        await self._transport.pause(_id(instance_id))

    async def resume(self, instance_id: str) -> None:
        await self._transport.resume(_id(instance_id))

    async def status(self, instance_id: str) -> InstanceStatus:
        return await self._transport.status(_id(instance_id))

    async def result(self, instance_id: str, *, timeout: float | None = 60.0) -> Any:
        """The workflow's return value; raises ``WorkflowFailed`` or ``WorkflowCancelled``
        if it did not complete, ``ResultTimeout`` if it is still running after
        ``timeout`` seconds."""
        return await self._transport.result(_id(instance_id), timeout)

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        return await self._transport.history(_id(instance_id))

    async def list(self, *, status: str | None = None) -> list[InstanceStatus]:
        return await self._transport.list(status)

    async def list_page(
        self,
        *,
        status: str | None = None,
        workflow: str | None = None,
        prefix: str = "",
        after: str | None = None,
        limit: int = DEFAULT_PAGE_SIZE,
    ) -> InstancePage:
        """One page of instances in id order, filtered; pass the page's ``next`` as
        ``after`` for the following one (None: there is none). Fast however many
        instances there are: the owners read their state from the cursor on."""
        return await self._transport.list_page(
            ListQuery(status, workflow, prefix, after, max(1, min(limit, MAX_PAGE_SIZE)))
        )

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _id(instance_id: str) -> str:
    """Refused before it travels: an id no instance can have (``InvalidPayload``)."""
    return check_name(instance_id, "instance id")


class _Connecting:
    """Awaitable (``client = await Client.connect(...)``) and an async context manager."""

    def __init__(self, pending: Awaitable[Transport]) -> None:
        self._pending = pending
        self._client: Client | None = None

    def __await__(self) -> Any:
        return self._open().__await__()

    async def _open(self) -> Client:
        self._client = Client(await self._pending)
        return self._client

    async def __aenter__(self) -> Client:
        return await self._open()

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()
