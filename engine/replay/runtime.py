"""The instance runtime: one workflow instance, its state, and its (cached) coroutine.

``handle`` takes one input (a command or a step outcome), decides the history records it
causes, folds them into the state, and drives the workflow code until it is blocked
again. It never performs I/O: step bodies to launch, timers to schedule and records to
append are returned in ``Output`` and only take effect after the processor made them
durable. If that commit fails, the processor drops the runtime and replays it later.

Replay: a runtime built from stored state starts a fresh coroutine; every ``ctx`` call
finds its replay key in the state and returns the recorded outcome at once, until the
code reaches the frontier. At the first quiet point every recorded entry must have been
visited, otherwise the code no longer matches the history (``HistoryDiverged``).
"""

from __future__ import annotations

from stepstream.engine.api.context import Context
from stepstream.engine.replay.calls import CallsMixin
from stepstream.engine.replay.effects import (
    CANCELLED_ATTEMPT,
    LOST_ATTEMPT,
    PATCH_PREFIX,
    TIMER_PURPOSES,
    Output,
    Phase,
    StepLaunch,
    StepOutcome,
)
from stepstream.engine.replay.inputs import HANDLERS
from stepstream.engine.replay.state import EntryKind
from stepstream.engine.wire.records import (
    Command,
)

# What a processor needs to drive a runtime, importable beside it.
__all__ = [
    "CANCELLED_ATTEMPT",
    "LOST_ATTEMPT",
    "PATCH_PREFIX",
    "InstanceRuntime",
    "Output",
    "StepLaunch",
    "StepOutcome",
]


class InstanceRuntime(CallsMixin):
    """One workflow instance: ``handle`` an input, or ``recover`` after a restart. Its
    parts, by job: ``core`` (state, records, futures), ``outgoing`` (commands for other
    instances), ``driving`` (running the code), ``calls`` (what ``Context`` calls) and
    ``inputs`` (one handler per kind of input)."""

    # ---- entry points ---------------------------------------------------------------

    def _context(self) -> Context:
        return Context(self)

    def handle(self, msg: Command | StepOutcome, out: Output) -> None:
        self._out = out
        self.ignored = False
        self._command_id = msg.command_id
        # What this causes carries the trace of the command, else the run's (``_emit``).
        self._traceparent = self.state.traceparent
        self._tracestate = self.state.tracestate
        if isinstance(msg, Command):
            if msg.traceparent is not None:
                self._traceparent = msg.traceparent
                self._tracestate = msg.tracestate
            if msg.command_id in self.state.recent_commands:
                return  # already applied: a re-delivered command changes nothing
        handler = HANDLERS.get(type(msg))
        if handler is None:
            raise TypeError(f"unexpected input {type(msg).__name__}")
        handler(self, msg)

    def recover(self, out: Output) -> None:
        """Resume an instance loaded after a restart: replays its code, re-runs attempts
        that were in flight when the previous owner stopped, and publishes again the
        starts of children it still waits for (a start is idempotent; a finished child
        answers it with its outcome again). Sleeps, timeouts and retries that fell due
        meanwhile are not decided here: their durable timers fire through the command
        log, so commands already on it (a cancel sent while no worker ran) apply first."""
        self._out = out
        self._command_id = f"recover:{self.epoch}"
        self._traceparent = self.state.traceparent
        self._tracestate = self.state.tracestate
        for entry in self._waited_children():
            self._out.commands.append((self.state.instance_id, self._child_start(entry)))
        # A race's cancels of its losers' children are published with its records, which
        # a commit cut short may have kept without them (Kafka); a child applies one once.
        for race, child in self._children_of_lost_races():
            self._cancel_children([child], self._race_lost_reason(race))
        # Published with their records, which a commit cut short may have kept without
        # them (Kafka); the receiver applies a message's command id once.
        for entry in self.state.entries.values():
            if entry.kind is EntryKind.SENT:
                self._publish_message(entry, self._message(entry))
        # Timers that fell due while no one ran the instance are armed again: a fire that
        # was dropped (a parked instance's retry, a retry an older version's drain held
        # back) would leave it waiting for ever; a second fire changes nothing.
        for entry in self.state.pending_timers():
            purpose = TIMER_PURPOSES.get(entry.state)
            if purpose is not None and self._overdue(entry):
                self._schedule(entry, purpose)
        previous, self._phase = self._phase, Phase.RECOVERING
        try:
            self._drive()
        finally:
            self._phase = previous
