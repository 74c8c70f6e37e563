"""What a log line is about: the instance (and step attempt) being processed when it
was emitted, as fields for the log formatter (``ops/telemetry/logs.py``).

The partition processor sets ``current`` while it applies an input to an instance, and
the step executor sets it in each step body's context, so any line logged meanwhile
(the engine's, or the workflow author's own ``logging`` calls inside a step) carries the
instance's fields. A line logged elsewhere about an instance (after a commit, from a
timer callback) passes them with ``extra=``: ``instance_fields`` or
``_Attempt.log_fields`` in ``consumers/steps.py``.

Fields are only computed when a line is logged: the hot path sets a context variable to
an object it already has. ``TRACE_OF`` carries what the instance's trace and run span
ids are derived from; the formatter turns it into ``trace_id`` and ``span_id``, the ids
of the spans the tracer exports for the run (``ops/telemetry/tracing.py``).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from stepstream.engine.replay.state import InstanceState

# The field holding (instance id, run start ms, traceparent or None).
TRACE_OF = "stepstream_trace_of"


class LogSubject(Protocol):
    def log_fields(self) -> dict[str, Any]:
        """``instance_id``, ``workflow``, ``partition`` and ``TRACE_OF``; ``step`` and
        ``attempt`` for a step attempt."""
        ...


current: ContextVar[LogSubject | None] = ContextVar("stepstream_log_subject", default=None)


def instance_fields(state: InstanceState, partition: int) -> dict[str, Any]:
    """The fields of a line about an instance, for ``extra=``."""
    return {
        "instance_id": state.instance_id,
        "workflow": state.workflow,
        "partition": partition,
        TRACE_OF: (state.instance_id, state.created_ms, state.traceparent),
    }


class InstanceSubject:
    """The instance a partition is applying an input to, if any (its state read when a
    line is logged, so a start applied in the same input already names its workflow).
    One per partition, set as ``current`` for a whole batch; the processor points it at
    each instance in turn, which costs less per input than setting the variable."""

    __slots__ = ("partition", "state")

    def __init__(self, partition: int) -> None:
        self.state: InstanceState | None = None
        self.partition = partition

    def log_fields(self) -> dict[str, Any]:
        state = self.state
        return {} if state is None else instance_fields(state, self.partition)
