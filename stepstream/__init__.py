"""stepstream: durable workflows for Python, event-sourced on Kafka.

This is the one import path users need::

    from stepstream import workflow, Context, Client, Worker, RetryPolicy, NonRetryableError
"""

from stepstream.engine.api.attempts import attempt_cancelled
from stepstream.engine.api.context import ChildHandle, Context, StepFailure, StepResult
from stepstream.engine.api.hook_events import StatusChangeEvent, StepErrorEvent
from stepstream.engine.api.loops import Break, Continue
from stepstream.engine.api.outbox import Published
from stepstream.engine.api.queues import Queue
from stepstream.engine.api.retry import RetryPolicy
from stepstream.engine.api.sources import Source
from stepstream.engine.api.workflow import workflow
from stepstream.engine.errors import (
    AccessDenied,
    ChildFailed,
    ConnectionFailed,
    EventTimeout,
    HistoryDiverged,
    InstanceExists,
    InstanceFinished,
    InstanceNotPaused,
    InvalidPayload,
    InvalidWorkflowCall,
    JoinError,
    NonRetryableError,
    PayloadTooLarge,
    RaceError,
    ResultTimeout,
    RolledBack,
    StepFailed,
    StepstreamError,
    StepTimeout,
    UnknownInstance,
    UnknownWorkflow,
    WorkflowCancelled,
    WorkflowFailed,
    WorkflowTerminated,
    WorkflowTimeout,
)
from stepstream.engine.reads.views import HistoryEntry, InstanceStatus
from stepstream.engine.version import version as _version
from stepstream.engine.wire.codec import JsonCodec, PayloadCodec
from stepstream.engine.wire.records import Payload
from stepstream.ops.worker import Worker
from stepstream.producers.client import Client
from stepstream.producers.schedules import ScheduleInfo

# The distribution's version (pyproject.toml's); ``stepstream --version`` says it too.
__version__ = _version()

__all__ = [
    "AccessDenied",
    "Break",
    "ChildFailed",
    "ChildHandle",
    "Client",
    "ConnectionFailed",
    "Context",
    "Continue",
    "EventTimeout",
    "HistoryDiverged",
    "HistoryEntry",
    "InstanceExists",
    "InstanceFinished",
    "InstanceNotPaused",
    "InstanceStatus",
    "InvalidPayload",
    "InvalidWorkflowCall",
    "JoinError",
    "JsonCodec",
    "NonRetryableError",
    "Payload",
    "PayloadCodec",
    "PayloadTooLarge",
    "Published",
    "Queue",
    "RaceError",
    "ResultTimeout",
    "RetryPolicy",
    "RolledBack",
    "ScheduleInfo",
    "Source",
    "StatusChangeEvent",
    "StepErrorEvent",
    "StepFailed",
    "StepFailure",
    "StepResult",
    "StepTimeout",
    "StepstreamError",
    "UnknownInstance",
    "UnknownWorkflow",
    "Worker",
    "WorkflowCancelled",
    "WorkflowFailed",
    "WorkflowTerminated",
    "WorkflowTimeout",
    "attempt_cancelled",
    "workflow",
]
