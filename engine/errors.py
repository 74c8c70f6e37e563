"""The core error classes: those of the client calls and of workflow code.

Every class means one thing a user can act on, and says whether the same call may simply
be made again (``retriable``). The whole tree, with the classes that live beside the code
raising them (storage, Kafka, configuration, tools), is drawn in ``stepstream.errors``,
the one module every error can be imported from.

Internal control-flow signals (``Evicted``) derive from ``BaseException`` so that a
workflow's ``except Exception`` can never swallow them.
"""

from __future__ import annotations


class StepstreamError(Exception):
    """Base of every error stepstream raises to users."""

    retriable: bool = False


class UnknownWorkflow(StepstreamError):
    """No worker has a workflow registered under that name (and version)."""


class DuplicateWorkflow(StepstreamError, ValueError):
    """Two different functions are registered under one workflow name and version."""


class InvalidPayload(StepstreamError):
    """Input, event payload or result that the payload codec cannot encode or decode."""


class PayloadTooLarge(StepstreamError):
    """An encoded payload is over the configured size limit."""


class UnknownInstance(StepstreamError):
    """No instance with that id exists."""


class InstanceFinished(StepstreamError):
    """The instance already completed, failed, was cancelled or terminated."""


class InstanceExists(StepstreamError):
    """A start with ``if_exists="fail"`` found an instance with that id; the message
    names its status. Start it under another id, or with another ``if_exists``."""

    def __init__(self, message: str, *, instance_id: str = "", status: str = "") -> None:
        super().__init__(message)
        self.instance_id = instance_id
        self.status = status


class InstanceNotPaused(StepstreamError):
    """A resume of an instance that is not paused (it is recorded and ignored)."""


class UnknownReplayKey(StepstreamError):
    """A reset or fork to a replay key the instance's history does not have (the
    message names the keys it has)."""


class InstanceNotFailed(StepstreamError):
    """A retry of an instance that has not failed (it is recorded and ignored)."""


class WorkflowFailed(StepstreamError):
    """The workflow raised, or a step failed and the workflow did not handle it."""

    def __init__(self, message: str, *, instance_id: str = "", error_type: str = "") -> None:
        super().__init__(message)
        self.instance_id = instance_id
        self.error_type = error_type


class WorkflowCancelled(StepstreamError):
    """The instance was cancelled before it finished."""

    def __init__(self, message: str, *, instance_id: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.instance_id = instance_id
        self.reason = reason


class WorkflowTimeout(WorkflowFailed):
    """The run passed its ``@workflow(timeout=)``: the instance failed with this error
    type (``result()`` raises it; it is a ``WorkflowFailed``)."""


class WorkflowTerminated(WorkflowCancelled):
    """The instance was terminated (``terminate``): ended at once, no compensations.
    ``result()`` raises it; it is a ``WorkflowCancelled``."""


class ResultTimeout(StepstreamError, TimeoutError):
    """``Client.result`` gave up waiting; the instance is still running."""

    retriable = True


class ConnectionFailed(StepstreamError):
    """The client could not reach the engine at the given address."""

    retriable = True


class AccessDenied(StepstreamError):
    """The API refused the request: no token or a wrong one (HTTP 401), or a request
    from another web site or to a host name the server does not answer to (403). Fix
    the token (``STEPSTREAM_API_TOKEN``, ``token=``) or the address; do not retry as is."""


class UndecodableRecord(StepstreamError):
    """Bytes on a topic that are not a record this version of stepstream can read."""


class HistoryDiverged(StepstreamError):
    """The recorded history of an instance no longer matches what the code does."""

    # How a parked instance's error names why (``stepstream status``), and what to do.
    parked_as = "HistoryDiverged"
    advice = "deploy code that matches its history to let it go on"

    def __init__(self, message: str, *, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class RecordedPayloadUnreadable(HistoryDiverged):
    """A value in an instance's history that this engine's codec cannot decode (another
    codec wrote it, or a key it needs was dropped or is not here yet). It was readable
    when recorded, so the code is not at fault: the instance is parked, not failed, and
    goes on once an engine with the codec and keys that wrote it loads it."""

    parked_as = "InvalidPayload"
    advice = "start the engine with the codec and keys that wrote it to let it go on"


class NonRetryableError(Exception):
    """Raise from a step body to fail the step at once, without further attempts."""


class OutboxNotConfigured(NonRetryableError):
    """``ctx.publish`` ran on an engine that has no Kafka cluster to publish to (an
    embedded engine without ``STEPSTREAM_OUTBOX_BOOTSTRAP``): the publish fails at once
    (``StepFailed`` in the workflow) with a message naming the variable."""


class StepFailed(StepstreamError):
    """A step used up its attempts (or raised NonRetryableError). Raised into the
    workflow at the ``await ctx.step(...)``; the workflow may catch it. ``kind`` says
    how it failed: "exhausted", "timeout", "non_retryable" or "cancelled"."""

    def __init__(
        self,
        message: str,
        *,
        key: str = "",
        attempts: int = 0,
        error_type: str = "",
        error_message: str = "",
        kind: str = "exhausted",
    ) -> None:
        super().__init__(message)
        self.key = key
        self.attempts = attempts
        self.error_type = error_type
        self.error_message = error_message
        self.kind = kind


class JoinError(StepstreamError):
    """Some branches of ``ctx.join`` raised. Every branch settled first: ``errors`` maps
    the failed branches to their exceptions, ``results`` the others to their values."""

    def __init__(
        self, message: str, *, errors: dict[str, BaseException], results: dict[str, object]
    ) -> None:
        super().__init__(message)
        self.errors = errors
        self.results = results


class RolledBack(StepstreamError):
    """An exception left a ``ctx.saga`` block; the compensations of the steps completed
    in it ran, newest first. ``cause`` is that exception; ``compensation_errors`` maps
    steps whose compensation failed for good to its ``StepFailed``."""

    def __init__(
        self,
        message: str,
        *,
        cause: BaseException,
        compensation_errors: dict[str, StepFailed] | None = None,
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.compensation_errors = compensation_errors or {}


class ChildFailed(StepstreamError):
    """A child workflow failed or was cancelled; ``status`` says which, ``error_type``
    and ``error`` what happened."""

    def __init__(
        self, message: str, *, child_id: str, status: str, error_type: str = "", error: str = ""
    ) -> None:
        super().__init__(message)
        self.child_id = child_id
        self.status = status
        self.error_type = error_type
        self.error = error


class RaceError(StepstreamError):
    """Every branch of ``ctx.race`` raised; ``errors`` maps each to its exception."""

    def __init__(self, message: str, *, errors: dict[str, BaseException]) -> None:
        super().__init__(message)
        self.errors = errors


class InvalidWorkflowCall(StepstreamError, ValueError):
    """Workflow code used the context in a way that cannot be replayed: a name that is
    empty or holds a reserved character (``#``, ``/``) or a control character, one name
    used by two concurrent branches of one scope, or a ``ctx`` method called inside a
    step body. Raised at the call; fix the workflow code."""


class StepTimeout(StepstreamError, TimeoutError):
    """One attempt of a step ran longer than its ``timeout``."""


class EventTimeout(StepstreamError, TimeoutError):
    """``ctx.wait_for_event`` (or ``ctx.messages.next``) reached its timeout before the
    event (or one of the messages) arrived; ``event_name`` names what it waited for."""

    def __init__(self, message: str, *, key: str = "", event_name: str = "") -> None:
        super().__init__(message)
        self.key = key
        self.event_name = event_name


class Evicted(BaseException):
    """Raised by ``ctx`` calls in a workflow coroutine that is being discarded (evicted
    from the cache, paused, handed to a new owner): the coroutine is unwinding and
    records nothing. Internal control flow: do not catch it."""
