"""Commands one instance sends others: child starts and cancels, a finished child's
notice to its parent, the refusal of a start under a taken id, and messages."""

from __future__ import annotations

from typing import Any

from stepstream.engine.errors import (
    StepstreamError,
)
from stepstream.engine.replay.core import RuntimeCore, _child_result_key
from stepstream.engine.replay.ids import child_command, child_done, child_event, message_command
from stepstream.engine.replay.state import Entry, EntryKind, EntryState
from stepstream.engine.wire.codec import (
    decode_safely,
    encode_safely,
)
from stepstream.engine.wire.records import (
    CancelWorkflow,
    Payload,
    SendEvent,
    StartWorkflow,
    TerminateWorkflow,
)
from stepstream.engine.wire.run_trace import run_traceparent


class OutgoingMixin(RuntimeCore):
    """Commands this instance sends other instances: its children's starts and cancels,
    the notice a child sends its parent, refusals of a start, and messages."""

    def _waited_children(self) -> list[Entry]:
        """Children whose outcome has not arrived yet."""
        entries = self.state.entries
        arrived = {b.name for b in self.state.buffered}
        return [
            e
            for e in entries.values()
            if e.kind is EntryKind.CHILD
            and child_event(e.key) not in arrived
            and (
                (result := entries.get(_child_result_key(e.key))) is None or not result.state.final
            )
        ]

    def _child_start(self, entry: Entry) -> StartWorkflow:
        assert entry.child_id is not None and entry.result is not None
        return StartWorkflow(
            instance_id=entry.child_id,
            command_id=child_command(self.state.instance_id, entry.key, self.state.run),
            time_ms=self.clock.now_ms(),
            workflow=entry.event_name or "",
            input=entry.result,
            # The child's run is a span of this run, in this run's trace (whatever
            # trace the input that started it came in).
            traceparent=self._run_trace()[0],
            tracestate=self._run_trace()[1],
        )

    def _run_trace(self) -> tuple[str, str | None]:
        """This run's span as W3C trace context, for what it sends other instances."""
        state = self.state
        return (
            run_traceparent(state.instance_id, state.created_ms, state.traceparent),
            state.tracestate,
        )

    def _notify_parent(self, run: int = 1) -> None:
        """A child that finished tells its parent how (an event only the parent's code
        waits for), with a command id that makes a repeated notice apply once."""
        state = self.state
        outcome: dict[str, Any] = {"status": state.status.value}
        if state.result is not None:
            try:
                outcome["result"] = decode_safely(self.codec, state.result)
            except StepstreamError as exc:
                outcome.update(status="failed", error_type="InvalidPayload", error=str(exc))
        if state.error_type:
            outcome.update(error_type=state.error_type, error=state.error_message)
        if state.cancel_reason:
            outcome["error"] = state.cancel_reason
        notice = child_outcome(
            state.parent_id,
            state.parent_key,
            child_done(state.instance_id, run),
            encode_safely(self.codec, outcome),
            self.clock.now_ms(),
            *self._run_trace(),  # the parent's activation links to this run
        )
        self._out.commands.append((state.instance_id, notice))

    def _refuse_child(self, msg: StartWorkflow, parent_id: str, key: str) -> None:
        """A parent asked to start this instance as its child ``key``, but it exists
        already and is not that child (a client or another parent took the id): the
        parent's call fails at once rather than waiting for an outcome that is not its."""
        state = self.state
        outcome = {
            "status": "failed",
            "error_type": "InstanceExists",
            "error": (
                f"instance {state.instance_id} already exists (workflow {state.workflow}, "
                f"status {state.status.value}); start the child with an id of its own "
                "(instance_id=None names it after its parent)"
            ),
        }
        refusal = child_outcome(
            parent_id,
            key,
            # Its own id: the parent may meet this instance again under another key.
            f"childexists:{msg.command_id}",
            encode_safely(self.codec, outcome),
            self.clock.now_ms(),
            msg.traceparent,
            msg.tracestate,
        )
        self._out.commands.append((state.instance_id, refusal))

    def _cancel_children(
        self, children: list[Entry], reason: str, *, terminate: bool = False
    ) -> None:
        """Cancel (or terminate) children; the command id makes it apply once."""
        cls = TerminateWorkflow if terminate else CancelWorkflow
        prefix = "terminatechild" if terminate else "cancelchild"
        for entry in children:
            assert entry.child_id is not None
            self._out.commands.append(
                (
                    self.state.instance_id,
                    cls(
                        instance_id=entry.child_id,
                        command_id=f"{prefix}:{entry.child_id}",
                        time_ms=self.clock.now_ms(),
                        reason=reason,
                    ),
                )
            )

    def _race_lost_reason(self, key: str) -> str:
        return f"it was started in a losing branch of race {key!r} of {self.state.instance_id}"

    def _children_of_lost_races(self) -> list[tuple[str, Entry]]:
        """(race key, child) for the children started in the losing branches of decided
        races whose outcome has not arrived."""
        entries = self.state.entries
        races = [
            (e.key, tuple(e.losers))
            for e in entries.values()
            if e.kind is EntryKind.RACE and e.losers
        ]
        if not races:
            return []
        # The race withdrew the losers' waits, so an outcome that came after it was buffered.
        arrived = {b.name for b in self.state.buffered}
        running = [
            e
            for e in entries.values()
            if e.kind is EntryKind.CHILD
            and child_event(e.key) not in arrived
            and (
                (result := entries.get(_child_result_key(e.key))) is None
                or result.state is EntryState.ABANDONED
            )
        ]
        return [(key, c) for key, losers in races for c in running if c.key.startswith(losers)]

    def _message(self, entry: Entry) -> SendEvent:
        assert entry.child_id is not None and entry.result is not None
        return SendEvent(
            instance_id=entry.child_id,
            # A restarted run's messages are new ones: the receiver applies an id once.
            command_id=message_command(
                self.state.instance_id,
                entry.key if self.state.run == 1 else f"run{self.state.run}/{entry.key}",
            ),
            time_ms=self.clock.now_ms(),
            name=entry.event_name or "",
            payload=entry.result,
            # The receiver's activation links to this run.
            traceparent=self._run_trace()[0],
            tracestate=self._run_trace()[1],
        )


def child_outcome(
    parent_id: str,
    key: str,
    command_id: str,
    outcome: Payload,
    time_ms: int,
    traceparent: str | None = None,
    tracestate: str | None = None,
) -> SendEvent:
    """The event that tells a parent how its child ``key`` ended (a dict with its status,
    result or error): only the parent's code waits for it, and ``command_id`` makes a
    repeat of it apply once."""
    return SendEvent(
        instance_id=parent_id,
        command_id=command_id,
        time_ms=time_ms,
        name=child_event(key),
        payload=outcome,
        traceparent=traceparent,
        tracestate=tracestate,
    )
