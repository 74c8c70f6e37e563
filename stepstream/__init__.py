"""stepstream: durable workflows for Python, event-sourced on Kafka.

This is the one import path users need::

    from stepstream import workflow, Context, Client, Worker, RetryPolicy, NonRetryableError
"""

from engine.attempts import attempt_cancelled
from engine.codec import JsonCodec, PayloadCodec
from engine.context import Context
from engine.errors import (
    AccessDenied,
    ConnectionFailed,
    EventTimeout,
    HistoryDiverged,
    InstanceFinished,
    InstanceNotPaused,
    InvalidPayload,
    NonRetryableError,
    PayloadTooLarge,
    ResultTimeout,
    StepFailed,
    StepstreamError,
    StepTimeout,
    UnknownInstance,
    UnknownWorkflow,
    WorkflowCancelled,
    WorkflowFailed,
)
from engine.records import Payload
from engine.retry import RetryPolicy
from engine.views import HistoryEntry, InstanceStatus
from engine.workflow import workflow
from ops.worker import Worker
from producers.client import Client

__all__ = [
    "AccessDenied",
    "Client",
    "ConnectionFailed",
    "Context",
    "EventTimeout",
    "HistoryDiverged",
    "HistoryEntry",
    "InstanceFinished",
    "InstanceNotPaused",
    "InstanceStatus",
    "InvalidPayload",
    "JsonCodec",
    "NonRetryableError",
    "Payload",
    "PayloadCodec",
    "PayloadTooLarge",
    "ResultTimeout",
    "RetryPolicy",
    "StepFailed",
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
