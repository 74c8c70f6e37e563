"""stepstream: durable workflows for Python, event-sourced on Kafka.

This is the one import path users need::

    from stepstream import workflow, Context, Client, Worker, RetryPolicy, NonRetryableError

Each name is imported when first asked for (PEP 562), so a process that needs one part
(the CLI talking to an engine over HTTP, a step's own module) does not pay for every
other: ``stepstream --help`` starts in half the time it took when this module imported
the engine, both backends and the HTTP server up front.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str
    from stepstream.engine.api.attempts import attempt_cancelled
    from stepstream.engine.api.context import (
        ChildHandle,
        Context,
        StepFailure,
        StepResult,
    )
    from stepstream.engine.api.hook_events import (
        StatusChangeEvent,
        StepErrorEvent,
    )
    from stepstream.engine.api.loops import (
        Break,
        Continue,
    )
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
    from stepstream.engine.reads.views import (
        HistoryEntry,
        InstanceStatus,
    )
    from stepstream.engine.wire.codec import (
        JsonCodec,
        PayloadCodec,
    )
    from stepstream.engine.wire.records import Payload
    from stepstream.ops.worker import Worker
    from stepstream.producers.client import Client
    from stepstream.producers.schedules import ScheduleInfo

# Where each public name lives, for ``__getattr__``; the block above says the same to
# type checkers, and tests/unit/test_packaging.py checks that it, ``__all__`` and this
# agree.
_WHERE: dict[str, str] = {
    "attempt_cancelled": "stepstream.engine.api.attempts",
    "ChildHandle": "stepstream.engine.api.context",
    "Context": "stepstream.engine.api.context",
    "StepFailure": "stepstream.engine.api.context",
    "StepResult": "stepstream.engine.api.context",
    "StatusChangeEvent": "stepstream.engine.api.hook_events",
    "StepErrorEvent": "stepstream.engine.api.hook_events",
    "Break": "stepstream.engine.api.loops",
    "Continue": "stepstream.engine.api.loops",
    "Published": "stepstream.engine.api.outbox",
    "Queue": "stepstream.engine.api.queues",
    "RetryPolicy": "stepstream.engine.api.retry",
    "Source": "stepstream.engine.api.sources",
    "workflow": "stepstream.engine.api.workflow",
    "AccessDenied": "stepstream.engine.errors",
    "ChildFailed": "stepstream.engine.errors",
    "ConnectionFailed": "stepstream.engine.errors",
    "EventTimeout": "stepstream.engine.errors",
    "HistoryDiverged": "stepstream.engine.errors",
    "InstanceExists": "stepstream.engine.errors",
    "InstanceFinished": "stepstream.engine.errors",
    "InstanceNotPaused": "stepstream.engine.errors",
    "InvalidPayload": "stepstream.engine.errors",
    "InvalidWorkflowCall": "stepstream.engine.errors",
    "JoinError": "stepstream.engine.errors",
    "NonRetryableError": "stepstream.engine.errors",
    "PayloadTooLarge": "stepstream.engine.errors",
    "RaceError": "stepstream.engine.errors",
    "ResultTimeout": "stepstream.engine.errors",
    "RolledBack": "stepstream.engine.errors",
    "StepFailed": "stepstream.engine.errors",
    "StepstreamError": "stepstream.engine.errors",
    "StepTimeout": "stepstream.engine.errors",
    "UnknownInstance": "stepstream.engine.errors",
    "UnknownWorkflow": "stepstream.engine.errors",
    "WorkflowCancelled": "stepstream.engine.errors",
    "WorkflowFailed": "stepstream.engine.errors",
    "WorkflowTerminated": "stepstream.engine.errors",
    "WorkflowTimeout": "stepstream.engine.errors",
    "HistoryEntry": "stepstream.engine.reads.views",
    "InstanceStatus": "stepstream.engine.reads.views",
    "JsonCodec": "stepstream.engine.wire.codec",
    "PayloadCodec": "stepstream.engine.wire.codec",
    "Payload": "stepstream.engine.wire.records",
    "Worker": "stepstream.ops.worker",
    "Client": "stepstream.producers.client",
    "ScheduleInfo": "stepstream.producers.schedules",
}

# Reached as attributes of the package too, as when it imported them all up front.
_SUBPACKAGES = frozenset(
    {"consumers", "engine", "errors", "ops", "producers", "schemas", "testing"}
)

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


if not TYPE_CHECKING:
    # Hidden from type checkers: a module ``__getattr__`` would make every name, a
    # misspelt one too, type as Any. They read the imports above instead.

    def __getattr__(name: str) -> Any:
        if name == "__version__":
            # The distribution's version (pyproject.toml's); ``stepstream --version``.
            from stepstream.engine.version import version

            value: Any = version()
        elif name in _WHERE:
            value = getattr(importlib.import_module(_WHERE[name]), name)
        elif name in _SUBPACKAGES:  # ``stepstream.errors.X`` after ``import stepstream``
            value = importlib.import_module(f"stepstream.{name}")
        else:
            raise AttributeError(f"module 'stepstream' has no attribute {name!r}")
        globals()[name] = value  # asked once: later reads find it without this function
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_WHERE, "__version__"})
