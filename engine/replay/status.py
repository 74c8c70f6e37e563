"""The instance status machine: the statuses, which of them end a run, and the moves
between them that ``InstanceState`` accepts (anything else is ``InvalidTransition``)."""

from __future__ import annotations

from enum import StrEnum

from stepstream.engine.errors import StepstreamError


class Status(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TERMINATED = "terminated"

    @property
    def finished(self) -> bool:
        return self in _TERMINAL

    @property
    def restartable(self) -> bool:
        """Whether a start with ``if_exists="restart_if_failed"`` begins a new run."""
        return self in _RESTARTABLE


_TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.TERMINATED})
_RESTARTABLE = frozenset({Status.FAILED, Status.CANCELLED, Status.TERMINATED})
_ENDS = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.TERMINATED})
_ALLOWED: dict[Status, frozenset[Status]] = {
    Status.PENDING: _ENDS | {Status.RUNNING, Status.PAUSED},
    Status.RUNNING: _ENDS | {Status.PAUSED},
    # A resume goes back to what the instance was: running, or pending (not admitted).
    Status.PAUSED: frozenset(
        {Status.RUNNING, Status.PENDING, Status.CANCELLED, Status.FAILED, Status.TERMINATED}
    ),
    Status.COMPLETED: frozenset(),
    # A restart (WorkflowRestarted) begins a new run of an instance that ended so.
    Status.FAILED: frozenset({Status.PENDING}),
    Status.CANCELLED: frozenset({Status.PENDING}),
    Status.TERMINATED: frozenset({Status.PENDING}),
}


class InvalidTransition(StepstreamError):
    """A record asked for a status change the state machine does not allow."""


def check_transition(instance_id: str, old: Status, new: Status) -> None:
    """Raise ``InvalidTransition`` unless ``old -> new`` is a move the machine allows."""
    if new is not old and new not in _ALLOWED[old]:
        raise InvalidTransition(
            f"instance {instance_id}: {old.value} -> {new.value} is not a valid transition"
        )
