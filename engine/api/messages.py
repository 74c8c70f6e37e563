"""``ctx.messages``: queues of named messages, built on events.

A message is an event sent to the instance (``client.send_event``, ``client.request``,
or ``ctx.messages.send`` from another instance). Messages of a name wait in arrival
order until a ``next`` or ``next_batch`` takes them; events sent while the instance is
paused wait until it resumes. ``msg.complete(value)`` answers a client that sent the
message with ``request()``. Every call is recorded, so replay takes the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from stepstream.engine.api.attempts import refuse_in_step_body
from stepstream.engine.api.durations import seconds_of
from stepstream.engine.api.runtime import WorkflowRuntime
from stepstream.engine.errors import EventTimeout, InvalidWorkflowCall
from stepstream.engine.replay.ids import CHILD_EVENT_PREFIX
from stepstream.engine.wire.codec import PayloadCodec
from stepstream.engine.wire.names import (
    event_name_problem,
    name_problem,
    step_name_problem,
    whole_in,
)
from stepstream.engine.wire.records import Payload


@dataclass(frozen=True, slots=True)
class Message:
    """One message taken from the instance's queue."""

    id: str  # the command id it came with (unique)
    name: str
    payload: Any
    sent_at: datetime  # when it reached the instance
    _rt: WorkflowRuntime = field(repr=False, compare=False)

    async def complete(self, value: Any = None) -> None:
        """Answer the message: a client that sent it with ``request()`` gets ``value``.
        Recorded once; completing it again changes nothing."""
        refuse_in_step_body("msg.complete")
        self._rt.complete_message(self.id, value)


class Messages:
    """``ctx.messages``: take messages sent to this instance, send messages to others."""

    __slots__ = ("_codec", "_rt")

    def __init__(self, runtime: WorkflowRuntime, codec: PayloadCodec) -> None:
        self._rt = runtime
        self._codec = codec

    async def next(
        self, names: str | Sequence[str], *, timeout: float | timedelta | None = None
    ) -> Message:
        """The next message of ``names`` (a name or several), in arrival order; waits
        for one. ``EventTimeout`` after ``timeout``."""
        [message] = await self._take(names, 1, timeout, "next")
        return message

    async def next_batch(
        self,
        names: str | Sequence[str],
        *,
        max: int = 100,
        timeout: float | timedelta | None = None,
    ) -> list[Message]:
        """Up to ``max`` messages of ``names`` at once, as soon as there is at least one;
        ``[]`` if none arrived within ``timeout``."""
        if not whole_in(max, 1):
            raise InvalidWorkflowCall(
                f"next_batch needs max as a whole number of at least 1, not {max!r}"
            )
        try:
            return await self._take(names, max, timeout, "next_batch")
        except EventTimeout:
            return []

    async def send(self, instance_id: str, name: str, payload: Any = None) -> None:
        """Send ``payload`` as message (event) ``name`` to another instance: recorded,
        published once the record is durable, applied there exactly once."""
        refuse_in_step_body("ctx.messages.send")
        self._rt.send_message(self._rt.key_for("send"), instance_id, name, payload)

    async def _take(
        self,
        names: str | Sequence[str],
        max_messages: int,
        timeout: float | timedelta | None,
        what: str,
    ) -> list[Message]:
        refuse_in_step_body(f"ctx.messages.{what}")
        if isinstance(names, str):
            wanted = [names]
        elif isinstance(names, list | tuple):
            wanted = list(names)
        else:
            raise InvalidWorkflowCall(
                f"ctx.messages.{what}: give a message name or a list of them, not "
                f"{type(names).__name__} {names!r:.60}"
            )
        if not wanted:
            raise InvalidWorkflowCall(f"ctx.messages.{what} needs at least one name")
        for name in wanted:
            # A name a client may not send (or none at all) would be waited for in vain;
            # a child's notice of its end is the engine's own (the schedules take them).
            notice = isinstance(name, str) and name.startswith(CHILD_EVENT_PREFIX)
            problem = name_problem(name) if notice else event_name_problem(name)
            if problem is not None:
                raise InvalidWorkflowCall(
                    f"ctx.messages.{what}: message name {name!r:.60} {problem}"
                )
        limit = None
        if timeout is not None:
            # A timeout of 0 or less takes what has come and does not wait.
            negative = isinstance(timeout, int | float) and timeout < 0
            seconds = 0.0 if negative else seconds_of(timeout, f"ctx.messages.{what} timeout")
            limit = round(seconds * 1000)
        # Named for its one name where that is a step name (no '#' or '/'), as before.
        one = len(wanted) == 1 and step_name_problem(wanted[0]) is None
        key = self._rt.key_for(wanted[0] if one else "messages")
        raw = await self._rt.message_future(key, wanted, max_messages, limit)
        return [self._message(*m) for m in raw]

    def _message(self, message_id: str, name: str, payload: Payload, sent_ms: int) -> Message:
        return Message(
            id=message_id,
            name=name,
            payload=self._rt.decode_recorded(payload, f"the message {message_id!r} ({name!r})"),
            sent_at=datetime.fromtimestamp(sent_ms / 1000, tz=UTC),
            _rt=self._rt,
        )
