"""What became of a command, as the processor tells its publisher.

A settled command is ``None`` (applied, or a no-op such as pausing a paused instance) or
a reason string: the reason it went to dead-letters, or why it was recorded and ignored
(its instance had finished; a resume of an instance that is not paused).
Reasons cross process boundaries (HTTP, websocket), so they are plain strings with
well-known prefixes, turned back into the user's error here.
"""

from __future__ import annotations

from stepstream.engine.errors import (
    InstanceExists,
    InstanceFinished,
    InstanceNotFailed,
    InstanceNotPaused,
    StepstreamError,
    UnknownInstance,
    UnknownReplayKey,
    UnknownWorkflow,
)
from stepstream.engine.wire.records import Command, PauseWorkflow, ResumeWorkflow, StartWorkflow


def settled_key(instance_id: str, command_id: str) -> str:
    """How a settled command is known to the waiters: a command id is unique on its
    instance only (an event id a user gives may be used again on another instance), so
    the key names both. Instance ids hold no control character, so the NUL between them
    cannot come from either side of a valid id; one string, not a tuple, so the host's
    memory of settled commands stays small."""
    return f"{instance_id}\x00{command_id}"


FINISHED = "instance finished:"
NOT_PAUSED = "instance not paused:"
EXISTS = "instance exists:"
# How the CommandIgnored of a start refused by ``if_exists="fail"`` ends its reason.
REFUSED_START = "if_exists=fail"
UNKNOWN_INSTANCE = "unknown instance"
UNKNOWN_WORKFLOW = "unknown workflow"
IGNORED = "ignored"
# A reset or fork to a key the history lacks, a retry of an instance that has not
# failed: recorded (CommandIgnored) with the whole reason, which starts with these.
NO_SUCH_KEY = "no such key:"
NOT_FAILED = "instance not failed:"
REFUSALS = (NO_SUCH_KEY, NOT_FAILED)
_FINISHED_STATUSES = ("completed", "failed", "cancelled", "terminated")


_STATUSES = ("pending", "running", "paused", *_FINISHED_STATUSES)
_RESTARTABLE = ("failed", "cancelled", "terminated")


def finished_reason(status: str) -> str:
    return f"{FINISHED} {status}"


def recorded_reason(command_type: str, ignored_because: str) -> str | None:
    """The settlement of a command recorded as ignored (a ``CommandIgnored`` with its
    type and reason), for a publisher that asks after the fact (another owner now)."""
    if ignored_because.startswith(REFUSALS):
        return ignored_because
    words = ignored_because.replace(",", " ").replace(")", " ").split()
    if command_type == "StartWorkflow":
        if not ignored_because.endswith(REFUSED_START):
            return None  # a start of an existing id returns it
        return f"{EXISTS} {next((w for w in words if w in _STATUSES), '')}"
    finished = next((w for w in words if w in _FINISHED_STATUSES), None)
    if finished is not None:
        return finished_reason(finished)
    if command_type == "ResumeWorkflow" and "not paused" in ignored_because:
        status = next((w for w in words if w not in ("instance", "is", "not", "paused")), "")
        return f"{NOT_PAUSED} {status}"
    return None


def ignored_reason(command: Command, status: str) -> str | None:
    """What the publisher of a command recorded as ignored is told: nothing for a pause
    of a paused instance (pausing is idempotent), else why it had no effect."""
    if isinstance(command, StartWorkflow):
        # Refused only when its policy says so; else the existing instance is its answer.
        return f"{EXISTS} {status}" if command.if_exists == "fail" else None
    if status in _FINISHED_STATUSES:
        return finished_reason(status)
    if isinstance(command, ResumeWorkflow):
        return f"{NOT_PAUSED} {status}"
    if isinstance(command, PauseWorkflow):
        return None
    return f"{IGNORED} while {status}"


def recorded_and_ignored(reason: str) -> bool:
    """Whether ``reason`` says the command was recorded and ignored (its instance had
    finished, or was in a state the command had no effect on) rather than dead-lettered."""
    return reason.startswith((FINISHED, NOT_PAUSED, IGNORED, EXISTS, *REFUSALS))


def finished_error(instance_id: str, status: str, action: str) -> InstanceFinished:
    again = "start a new instance instead"
    if status == "failed":
        again = f"`stepstream retry {instance_id}` runs it on from where it failed, or {again}"
    elif status in _RESTARTABLE:
        again = (
            f"start it again under its id with --if-exists restart_if_failed "
            f'(if_exists="restart_if_failed"), or {again}'
        )
    return InstanceFinished(
        f"instance {instance_id} is already {status}; {action} has no "
        f"effect on a finished instance ({again})"
    )


def error_for(reason: str, instance_id: str, action: str) -> StepstreamError:
    if reason.startswith(FINISHED):
        return finished_error(instance_id, reason[len(FINISHED) :].strip(), action)
    if reason.startswith(NOT_PAUSED):
        status = reason[len(NOT_PAUSED) :].strip()
        return InstanceNotPaused(
            f"instance {instance_id} is {status}, not paused; only a paused instance can be "
            "resumed (check `stepstream status`)"
        )
    if reason.startswith(NO_SUCH_KEY):
        return UnknownReplayKey(reason[len(NO_SUCH_KEY) :].strip())
    if reason.startswith(NOT_FAILED):
        return InstanceNotFailed(reason[len(NOT_FAILED) :].strip())
    if reason.startswith(EXISTS):
        status = reason[len(EXISTS) :].strip()
        return InstanceExists(
            f"instance {instance_id} already exists (status {status}); start it under "
            'another id, or with the start policy "return" to get the existing one'
            + (', or "restart_if_failed" to run it again' if status in _RESTARTABLE else "")
            + " (if_exists= of the client and the HTTP API, --if-exists of the CLI)",
            instance_id=instance_id,
            status=status,
        )
    if reason.startswith(UNKNOWN_INSTANCE):
        return UnknownInstance(reason)
    if reason.startswith(UNKNOWN_WORKFLOW):
        return UnknownWorkflow(reason)
    if reason.startswith(IGNORED):
        return StepstreamError(f"{action} for instance {instance_id} was recorded and {reason}")
    return StepstreamError(f"command rejected and sent to dead-letters: {reason}")
