"""stepstream: durable workflows for Python, event-sourced on Kafka.

This is the one import path users need::

    from stepstream import workflow, Context, Client, Worker, RetryPolicy, NonRetryableError
"""

from engine.attempts import attempt_cancelled
from engine.codec import JsonCodec, PayloadCodec
from engine.context import ChildHandle, Context, StepFailure, StepResult
from engine.errors import (
    AccessDenied,
    ChildFailed,
    ConnectionFailed,
    EventTimeout,
    HistoryDiverged,
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
)
from engine.hook_events import StatusChangeEvent, StepErrorEvent
from engine.loops import Break, Continue
from engine.outbox import Published
from engine.records import Payload
from engine.retry import RetryPolicy
from engine.sources import Source
from engine.views import HistoryEntry, InstanceStatus
from engine.workflow import workflow
from ops.worker import Worker
from producers.client import Client

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
    "RaceError",
    "ResultTimeout",
    "RetryPolicy",
    "RolledBack",
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
    "attempt_cancelled",
    "workflow",
]
