"""The log lines about failures, made once the failure is durable (``Telemetry``, which
sees every committed record, calls these), so each is logged once, at the level its
outcome deserves:

- a step attempt that failed and will be retried: WARNING;
- a step that failed for good (its retries exhausted, or not retryable) and a workflow
  that failed: ERROR;
- an attempt given up because its step no longer needs it (``AttemptCancelled``: a race
  lost), and a run cancelled or terminated, with the attempts it gave up: INFO.

Each carries the failure as the engine has it: the traceback the step executor (or the
workflow task) formatted when the exception was raised in this process, else the
recorded ``error_type: error_message`` (a timeout, a lost attempt). The history keeps
only the latter (``StepFailed``, ``WorkflowFailed``). A traceback whose every frame is
stepstream's own (the engine refusing a call: ``ctx.publish`` with no outbox set up) is
left out: it would only repeat the message the line already carries.
"""

from __future__ import annotations

import logging
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stepstream.consumers.log_context import TRACE_OF, instance_fields
from stepstream.engine.replay.core import WORKFLOW_TRACEBACK
from stepstream.engine.wire.records import (
    StepFailedRecord,
    WorkflowCancelledRecord,
    WorkflowFailedRecord,
    WorkflowTerminatedRecord,
)

if TYPE_CHECKING:
    from stepstream.engine.replay.runtime import InstanceRuntime

step_log = logging.getLogger("stepstream.steps")
run_log = logging.getLogger("stepstream.workflows")

_CANCELLED = "AttemptCancelled"
# A frame's line in a formatted traceback, and where this package's files are.
_FRAME = re.compile(r'^  File "(.+?)", line \d+', re.MULTILINE)
# Not resolved: the frames name files by the path they were imported from, stepstream/...
_OURS = os.path.join(str(Path(__file__).parents[1]), "")


def _worth_showing(traceback: str) -> str:
    """``traceback``, or "" when it has no frame outside stepstream (nothing in it would
    point the reader at their code). Kept whole when it may hold frames this cannot see:
    clipped at its start (``format_traceback``), or with an exception group's frames."""
    if traceback.startswith("[") and "characters cut]" in traceback[:80]:
        return traceback
    if "\n  | " in traceback or "\n  +-" in traceback:
        return traceback
    frames = _FRAME.findall(traceback)
    if frames and all(frame.startswith(_OURS) for frame in frames):
        return ""
    return traceback


def step_failed(partition: int, record: StepFailedRecord, runtime: InstanceRuntime | None) -> None:
    traceback = runtime.tracebacks.pop((record.key, record.attempt), "") if runtime else ""
    shown = _worth_showing(traceback)
    if record.error_type == _CANCELLED:
        level = logging.INFO
        message = "step attempt cancelled: %s"
        args: tuple[Any, ...] = (record.error_message,)
    elif record.next_attempt_at_ms is not None:
        level = logging.WARNING
        message = "step attempt failed, will retry at %s: %s: %s"
        retry_at = datetime.fromtimestamp(record.next_attempt_at_ms / 1000, tz=UTC)
        when = retry_at.isoformat(timespec="milliseconds")
        args = (when, record.error_type, record.error_message)
    else:
        level = logging.ERROR
        message = "step failed for good at attempt %d: %s: %s"
        args = (record.attempt, record.error_type, record.error_message)
    if not step_log.isEnabledFor(level):
        return
    fields = _fields(record.instance_id, partition, runtime)
    fields.update(step=record.key, attempt=record.attempt, error_type=record.error_type)
    if level == logging.INFO or (traceback and not shown):
        text = ""  # the message says it all
    else:
        text = shown or _recorded(record)
    _emit(step_log, level, message, args, fields, text)


def run_failed(
    partition: int, record: WorkflowFailedRecord, runtime: InstanceRuntime | None
) -> None:
    traceback = runtime.tracebacks.pop(WORKFLOW_TRACEBACK, "") if runtime else ""
    if not run_log.isEnabledFor(logging.ERROR):
        return
    fields = _fields(record.instance_id, partition, runtime)
    fields["error_type"] = record.error_type
    _emit(
        run_log,
        logging.ERROR,
        "workflow failed: %s: %s",
        (record.error_type, record.error_message),
        fields,
        traceback or _recorded(record),
    )


def run_stopped(
    partition: int,
    record: WorkflowCancelledRecord | WorkflowTerminatedRecord,
    runtime: InstanceRuntime | None,
    given_up: list[tuple[str, int]],
) -> None:
    """A run cancelled or terminated: INFO, with the step attempts it gave up."""
    if not run_log.isEnabledFor(logging.INFO):
        return
    how = "cancelled" if isinstance(record, WorkflowCancelledRecord) else "terminated"
    attempts = ", ".join(f"{key} (attempt {attempt})" for key, attempt in given_up)
    _emit(
        run_log,
        logging.INFO,
        "workflow %s: %s%s",
        (how, record.reason or "no reason given", f"; gave up {attempts}" if attempts else ""),
        _fields(record.instance_id, partition, runtime),
        "",
    )


def _fields(instance_id: str, partition: int, runtime: InstanceRuntime | None) -> dict[str, Any]:
    if runtime is None:  # not in this commit's instances: what the record says
        return {"instance_id": instance_id, "partition": partition, TRACE_OF: None}
    return instance_fields(runtime.state, partition)


def _recorded(record: StepFailedRecord | WorkflowFailedRecord) -> str:
    return f"{record.error_type}: {record.error_message}"


def _emit(
    logger: logging.Logger,
    level: int,
    message: str,
    args: tuple[Any, ...],
    fields: dict[str, Any],
    traceback: str,
) -> None:
    # The exception object may be gone (the failure was raised before the commit), so
    # its formatted text goes where a formatter looks for it: ``exc_text``.
    record = logger.makeRecord(logger.name, level, __file__, 0, message, args, None, extra=fields)
    if traceback:
        record.exc_text = traceback
    logger.handle(record)
