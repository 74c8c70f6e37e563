"""The engine's side of queues (``engine.api.queues``) in an instance's runtime: a
request for a slot is published with the start of the queue's instance, and an instance
that finishes gives back every slot it still holds or waits for."""

from __future__ import annotations

from stepstream.engine.api.queues import (
    QUEUE_ACQUIRE,
    QUEUE_INSTANCE_PREFIX,
    QUEUE_RELEASE,
    QUEUE_WORKFLOW,
)
from stepstream.engine.replay.core import RuntimeCore
from stepstream.engine.replay.ids import message_command
from stepstream.engine.replay.state import Entry, EntryKind
from stepstream.engine.wire.codec import decode_safely, encode_safely
from stepstream.engine.wire.records import Command, SendEvent, StartWorkflow

_ACQUIRE_SUFFIX = "#acquire"


class AdmissionMixin(RuntimeCore):
    def _queue_start(self, entry: Entry) -> StartWorkflow | None:
        """The start of the queue instance a request goes to, published before it: the
        first one makes the instance, every other one is a repeat of its command id and
        changes nothing."""
        target = entry.child_id or ""
        if entry.event_name != QUEUE_ACQUIRE or not target.startswith(QUEUE_INSTANCE_PREFIX):
            return None
        assert entry.result is not None
        request = decode_safely(self.codec, entry.result)
        limits = request.get("limits") if isinstance(request, dict) else None
        return StartWorkflow(
            instance_id=target,
            command_id=f"queuestart:{target}",
            time_ms=self.clock.now_ms(),
            workflow=QUEUE_WORKFLOW,
            input=encode_safely(self.codec, {"limits": limits}),
        )

    def _publish_message(self, entry: Entry, message: Command) -> None:
        start = self._queue_start(entry)
        if start is not None:
            self._out.commands.append((self.state.instance_id, start))
        self._out.commands.append((self.state.instance_id, message))

    def _withdraw_from_queues(self) -> None:
        """Release every slot this instance asked for and did not give back (a cancel,
        a failure past a held slot, a losing race branch): the queue drops a waiter and
        frees a holder; a release of what it no longer knows changes nothing."""
        entries = self.state.entries
        for entry in list(entries.values()):
            if (
                entry.kind is not EntryKind.SENT
                or entry.event_name != QUEUE_ACQUIRE
                or not entry.key.endswith(_ACQUIRE_SUFFIX)
            ):
                continue
            key = entry.key[: -len(_ACQUIRE_SUFFIX)]
            if f"{key}#release" in entries:
                continue
            assert entry.child_id is not None and entry.result is not None
            request = decode_safely(self.codec, entry.result)
            token = request.get("key", key) if isinstance(request, dict) else key
            run = self.state.run
            self._out.commands.append(
                (
                    self.state.instance_id,
                    SendEvent(
                        instance_id=entry.child_id,
                        command_id=message_command(
                            self.state.instance_id,
                            f"{key}#withdraw" if run == 1 else f"run{run}/{key}#withdraw",
                        ),
                        time_ms=self.clock.now_ms(),
                        name=QUEUE_RELEASE,
                        payload=encode_safely(
                            self.codec, {"instance": self.state.instance_id, "key": token}
                        ),
                    ),
                )
            )
