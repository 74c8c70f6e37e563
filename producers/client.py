"""``Client``: start workflows, send events, control and query instances.

One client API over several transports, chosen by the connect string:
``embedded:PATH`` (in-process engine), ``http://HOST:PORT`` (a ``stepstream dev`` or API
service) and ``kafka://HOST:PORT?prefix=P``. Transports register themselves by scheme, so
this module depends on none of them.
"""

from __future__ import annotations

import asyncio
import builtins
import importlib
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from stepstream.engine.api.attributes import AttributeValue
from stepstream.engine.api.durations import wait_timeout
from stepstream.engine.api.reserved_ids import reserved_id_problem
from stepstream.engine.api.schedule_spec import (
    DEFAULT_CATCHUP_WINDOW,
    ScheduleSpec,
)
from stepstream.engine.errors import (
    ConnectionFailed,
    InstanceExists,
    InvalidPayload,
    PayloadTooLarge,
    ResultTimeout,
    StepstreamError,
    UnknownInstance,
)
from stepstream.engine.reads.listing import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    ORDERS,
    InstancePage,
    ListQuery,
    Overview,
    check_status,
    parse_instant,
    where_pairs,
)
from stepstream.engine.reads.views import HistoryEntry, InstanceStatus, mark_set_aside
from stepstream.engine.wire.codec import MAX_MESSAGE_CHARS
from stepstream.engine.wire.names import (
    check_if_exists,
    check_name,
    event_id_problem,
    event_name_problem,
    name_problem,
    text_problem,
    whole_number_problem,
)
from stepstream.producers import schedules
from stepstream.producers.queue_positions import with_queue_positions
from stepstream.producers.schedules import ScheduleInfo

DEFAULT_CONNECT = "http://127.0.0.1:8233"
# How long ``fork`` waits for the new instance to be started by its owner.
_FORK_APPEARS_S = 10.0


class Transport(Protocol):
    async def start(
        self,
        workflow: str,
        input: Any,
        instance_id: str,
        version: str | None,
        if_exists: str = "return",
        *,
        priority: int | None = None,
        queue_key: str | None = None,
    ) -> str: ...

    async def send_event(
        self, instance_id: str, name: str, payload: Any, event_id: str | None = None
    ) -> None: ...

    async def reply(self, instance_id: str, message_id: str, timeout: float | None) -> Any: ...

    async def cancel(self, instance_id: str, reason: str) -> None: ...

    async def terminate(self, instance_id: str, reason: str) -> None: ...

    async def pause(self, instance_id: str) -> None: ...

    async def resume(self, instance_id: str) -> None: ...

    async def reset(self, instance_id: str, to: str, reason: str) -> None: ...

    async def retry(self, instance_id: str, reason: str) -> None: ...

    async def fork(self, instance_id: str, to: str, new_id: str) -> str: ...

    async def status(self, instance_id: str) -> InstanceStatus: ...

    async def result(self, instance_id: str, timeout: float | None) -> Any: ...

    async def history(self, instance_id: str) -> list[HistoryEntry]: ...

    async def list(self, status: str | None) -> list[InstanceStatus]: ...

    async def list_page(self, query: ListQuery) -> InstancePage: ...

    async def overview(self) -> Overview: ...

    async def close(self) -> None: ...


TransportFactory = Callable[[str, dict[str, Any]], Awaitable[Transport]]
_TRANSPORTS: dict[str, TransportFactory] = {}
# The built-in transports, each imported on first use (it registers itself). The
# embedded one lives with the engine it opens, in ``ops``: named here, not imported.
_BUILT_IN = {
    "embedded": "stepstream.ops.embedded",
    "http": "stepstream.producers.http.connect",
    "https": "stepstream.producers.http.connect",
    "kafka": "stepstream.producers.kafka",
}


def register_transport(scheme: str, factory: TransportFactory) -> None:
    _TRANSPORTS[scheme] = factory


def known_schemes() -> list[str]:
    """The URL schemes ``Client.connect`` takes: the built-in ones and any registered."""
    return sorted({*_TRANSPORTS, *_BUILT_IN})


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
            known = ", ".join(f"{s}:" for s in known_schemes()) or "none"
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
        priority: int | None = None,
        queue_key: str | None = None,
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
        versions there are).

        ``priority`` and ``queue_key`` place the instance in its workflow's queue
        (``@workflow(queue=...)``): lower priorities are admitted first, then in order of
        arrival; ``queue_key`` is the key (a tenant) of a ``per_key`` queue."""
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        check_name(workflow, "workflow name")
        check_name(instance_id, "instance id", _client_id_problem)
        if version is not None:
            check_name(version, f"version of workflow {workflow!r}:")
        check_if_exists(if_exists)
        problem = None if priority is None else whole_number_problem(priority)
        if problem is not None:
            raise InvalidPayload(f"priority of instance {instance_id} {problem}")
        if queue_key is not None:
            check_name(queue_key, "queue key")
        return await self._transport.start(
            workflow,
            input,
            instance_id,
            version,
            if_exists,
            priority=priority,
            queue_key=queue_key,
        )

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
        timeout = wait_timeout(timeout)  # before the message goes: a retry would send it twice
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

    async def reset(self, instance_id: str, *, to: str, reason: str = "") -> None:
        """Make the instance go on from just before the replay key ``to`` (a name its
        history shows, like ``"charge#2"``): what it recorded from there on is set aside
        (kept in its history, marked reset), the results before it replay, and its code
        runs on from there. ``UnknownReplayKey`` (naming the keys it has) if its history
        has no such key."""
        await self._transport.reset(_id(instance_id), _key(to), _reason(reason, instance_id))

    async def retry(self, instance_id: str, *, reason: str = "") -> None:
        """Make a failed instance go on from its failed step, with fresh attempts (or,
        if no step failed, run its code on from just before the failure).
        ``InstanceNotFailed`` if it has not failed."""
        await self._transport.retry(_id(instance_id), _reason(reason, instance_id))

    async def fork(self, source_id: str, /, *, to: str, instance_id: str | None = None) -> str:
        """Start a new instance whose history is ``source_id``'s up to (not including)
        the replay key ``to``, and return its id (``instance_id``, or a new one): the
        results before the key replay, and its code runs on from there. Its status
        says where it came from (``origin``). ``UnknownReplayKey`` if the source's
        history has no such key; the source is left as it is."""
        source = _id(source_id)
        new_id = (
            _id(instance_id) if instance_id is not None else f"{source}-fork-{uuid.uuid4().hex[:8]}"
        )
        if new_id == source:
            raise InvalidPayload(
                f"a fork of {source} needs an id of its own; leave instance_id out for a new one"
            )
        return await fork_instance(self._transport, source, _key(to), new_id)

    async def status(self, instance_id: str) -> InstanceStatus:
        """The instance's status; a wait for a queue slot says where it stands in the
        queue (``position``, 1 next, of ``waiting``)."""
        return await with_queue_positions(
            self._transport, await self._transport.status(_id(instance_id))
        )

    async def result(self, instance_id: str, *, timeout: float | None = 60.0) -> Any:
        """The workflow's return value; raises ``WorkflowFailed`` or ``WorkflowCancelled``
        if it did not complete, ``ResultTimeout`` if it is still running after
        ``timeout`` seconds."""
        return await self._transport.result(_id(instance_id), wait_timeout(timeout))

    async def history(self, instance_id: str) -> list[HistoryEntry]:
        """The instance's records in order, decoded; those a reset set aside say so
        (``set_aside``)."""
        return mark_set_aside(await self._transport.history(_id(instance_id)))

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
        since: datetime | str | None = None,
        until: datetime | str | None = None,
        order: str = "newest",
        where: Mapping[str, AttributeValue | Sequence[AttributeValue]] | None = None,
    ) -> InstancePage:
        """One page of instances, filtered, newest first by created time (``order=
        "oldest"``: oldest first; ``"id"``: in instance-id order); pass the page's
        ``next`` as ``after`` for the following one (None: there is none). ``since`` and
        ``until`` bound the created time (a datetime, an ISO 8601 string, or how long
        ago: ``"1h"``). Every order is fast however many instances there are: the
        owners read their state from the cursor on, in id order or from their index by
        created time; a status, workflow or ``where`` filter that few instances match
        reads every instance's summary in the time orders (``order="id"`` reads those in
        slices). ``where`` keeps the instances whose search attributes
        (``ctx.set_attributes``) equal every value it gives (numbers compare as numbers,
        ``1`` never equals ``True``; a list of values matches any of them)."""
        if order not in ORDERS:
            raise InvalidPayload(f"order={order!r} is not one of {', '.join(ORDERS)}")
        check_status(status or None)
        bounds = [
            None if t is None else parse_instant(_instant_text(t), name)
            for name, t in (("since", since), ("until", until))
        ]
        limit = max(1, min(limit, MAX_PAGE_SIZE))
        return await self._transport.list_page(
            ListQuery(
                status or None,
                workflow or None,
                prefix,
                after,
                limit,
                order,
                since=bounds[0],
                until=bounds[1],
                where=where_pairs(where or {}),
            )
        )

    # ---- schedules (producers/schedules.py) ----------------------------------------

    async def create_schedule(
        self,
        name: str,
        workflow: str,
        *,
        cron: str | None = None,
        every: int | None = None,
        input: Any = None,
        timezone: str = "UTC",
        overlap: str = "skip",
        catchup_window: int = DEFAULT_CATCHUP_WINDOW,
    ) -> ScheduleInfo:
        """Start an instance of ``workflow`` at each slot of ``cron`` (read in
        ``timezone``) or ``every`` seconds, with id ``<name>@<slot, UTC ISO 8601>``:
        exactly one per slot. ``overlap``: "skip" (a slot while the previous instance
        runs is skipped), "buffer_one" (held until it ends; later ones skipped) or
        "allow". A slot later than ``catchup_window`` seconds (the engine was down) is
        skipped and counted. Creating a name that exists replaces its spec."""
        spec = ScheduleSpec(name, workflow, input, cron, every, timezone, overlap, catchup_window)
        return await schedules.create(self._transport, spec)

    async def pause_schedule(self, name: str) -> None:
        """No slot starts until ``resume_schedule``; the slots meanwhile are not run."""
        await schedules.control(self._transport, name, "pause")

    async def resume_schedule(self, name: str) -> None:
        """Slots start again from the next one after now."""
        await schedules.control(self._transport, name, "resume")

    async def trigger_schedule(self, name: str) -> None:
        """Start one instance now, outside the slots (id ``<name>@<now, with ms>``)."""
        await schedules.control(self._transport, name, "trigger")

    async def delete_schedule(self, name: str) -> None:
        """No more slots start; instances it started go on."""
        await schedules.control(self._transport, name, "delete")

    async def describe_schedule(self, name: str) -> ScheduleInfo:
        """The schedule ``name``: its spec, next run, last instance, counters."""
        return await schedules.describe(self._transport, name)

    async def list_schedules(self) -> builtins.list[ScheduleInfo]:
        """Every schedule, by name, with its next run and last instance."""
        return await schedules.list_all(self._transport)

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _client_id_problem(value: object) -> str | None:
    """Why a client may not start (or fork into) an instance of this id: ids of schedules
    and queues are the engine's (``create_schedule``, ``Queue``)."""
    problem = name_problem(value)
    if problem is None and isinstance(value, str):
        return reserved_id_problem(value)
    return problem


async def fork_instance(transport: Transport, source: str, to: str, new_id: str) -> str:
    """Fork ``source`` at ``to`` into ``new_id`` over ``transport``: refused if ``new_id``
    exists; returns once the new instance's owner has started it (or a little later if
    none answers: it starts when a worker gets to it). The API server forks with this
    too, so every way of forking says the same."""
    check_name(new_id, "instance id", _client_id_problem)
    try:
        found = await transport.status(new_id)
    except (UnknownInstance, ConnectionFailed):
        pass  # free (or its owner is down: one that exists would record and ignore it)
    else:
        raise _taken(new_id, found)
    forked = await transport.fork(source, to, new_id)
    # The source's owner sends the start on, so no command of this client tells when the
    # new instance exists: wait a little for it, so a read right after finds it. What
    # took the id meanwhile (a start, another fork) stays, and this fork was ignored.
    delay, waited = 0.005, 0.0
    while waited < _FORK_APPEARS_S:
        try:
            found = await transport.status(forked)
            if found.origin != f"forked from {source} at {to}":
                raise _taken(new_id, found)
            break
        except UnknownInstance:
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 0.25)
        except (ConnectionFailed, ResultTimeout):
            break
    return forked


def _taken(new_id: str, found: InstanceStatus) -> InstanceExists:
    what = found.origin or f"an instance of {found.workflow}"
    return InstanceExists(
        f"instance {new_id} already exists ({found.status}, {what}); give the fork "
        "another id, or leave the id out for a new one",
        instance_id=new_id,
        status=found.status,
    )


def _key(key: str) -> str:
    if not isinstance(key, str) or not key.strip():
        raise InvalidPayload(
            f"replay key {key!r}: give a key the instance's history shows (for example "
            "charge#2; `stepstream history ID` lists them)"
        )
    problem = text_problem(key)
    if problem is not None:
        raise InvalidPayload(f"replay key {key!r} {problem}")
    return key


def _reason(reason: str, instance_id: str) -> str:
    if not isinstance(reason, str):
        raise InvalidPayload(f"the reason must be a string, not {type(reason).__name__}")
    problem = text_problem(reason)
    if problem is not None:
        raise InvalidPayload(f"the reason for instance {instance_id} {problem}")
    if len(reason) > MAX_MESSAGE_CHARS:
        raise PayloadTooLarge(
            f"the reason for instance {instance_id} is {len(reason)} characters, over the "
            f"limit of {MAX_MESSAGE_CHARS}; say it in fewer words"
        )
    return reason


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


def _instant_text(value: datetime | str) -> str:
    if isinstance(value, str):
        return value
    # A naive datetime is taken as UTC, as ISO 8601 text without a zone is.
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
