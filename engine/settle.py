"""What became of a command, as the processor tells its publisher.

A settled command is ``None`` (applied) or a reason string: the reason it went to
dead-letters, or that it was recorded and ignored because its instance had finished.
Reasons cross process boundaries (HTTP, websocket), so they are plain strings with
well-known prefixes, turned back into the user's error here.
"""

from __future__ import annotations

from engine.errors import InstanceFinished, StepstreamError, UnknownInstance, UnknownWorkflow

FINISHED = "instance finished:"
UNKNOWN_INSTANCE = "unknown instance"
UNKNOWN_WORKFLOW = "unknown workflow"


def finished_reason(status: str) -> str:
    return f"{FINISHED} {status}"


def finished_error(instance_id: str, status: str, action: str) -> InstanceFinished:
    return InstanceFinished(
        f"instance {instance_id} is already {status}; {action} has no "
        "effect on a finished instance (start a new instance instead)"
    )


def error_for(reason: str, instance_id: str, action: str) -> StepstreamError:
    if reason.startswith(FINISHED):
        return finished_error(instance_id, reason[len(FINISHED) :].strip(), action)
    if reason.startswith(UNKNOWN_INSTANCE):
        return UnknownInstance(reason)
    if reason.startswith(UNKNOWN_WORKFLOW):
        return UnknownWorkflow(reason)
    return StepstreamError(f"command rejected and sent to dead-letters: {reason}")
