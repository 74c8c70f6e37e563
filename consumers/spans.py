"""The spans the engine hands to a ``SpanSink``: plain tuples made on the hot path
(``consumers/telemetry.py``), turned into OpenTelemetry spans elsewhere
(``ops/telemetry/``), often in another process; and ``Activations``, what an activation
span is made of while its batch is built."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sized
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from stepstream.engine.replay.status import Status
from stepstream.engine.wire.records import Command, StartWorkflow

if TYPE_CHECKING:
    from stepstream.engine.replay.runtime import InstanceRuntime
    from stepstream.engine.replay.state import InstanceState


class StepSpan(NamedTuple):
    """One step attempt that ended, as a span: from its durable start to its outcome."""

    # The run (``RUN_FIELDS``, shared with ``ActivationSpan``).
    workflow: str
    instance_id: str
    partition: int
    run_start_ms: int  # the run's start: names the run span the attempt belongs to
    traceparent: str | None
    tracestate: str | None
    # The attempt.
    key: str
    step: str
    attempt: int
    start_ms: int
    end_ms: int
    outcome: str
    error_type: str
    error_message: str
    stacktrace: str  # the body's traceback when it raised here ("" if not known)


# The fields every span of a run begins with: a sink that takes flat spans
# (``FlatSpanSink``) gets them as one tuple, made once per run (``run_fields``).
RUN_FIELDS = 6


class Messaging(NamedTuple):
    """Where a backend's processors read commands from, for their spans: the messaging
    system that carries them ("" for none: the embedded engine's own log), the commands
    topic and the consumer group."""

    system: str
    destination: str
    group: str


IN_PROCESS = Messaging("", "", "")


class ActivationSpan(NamedTuple):
    """One activation of a run: the instance driven by the inputs one commit applied to
    it (commands, timer fires, step outcomes), from the first input of the commit's batch
    to the commit. The
    activation that started the run is the run span, which every other span of the run
    (its activations, its step attempts, its children's runs) names as its parent."""

    # The run (``RUN_FIELDS``, shared with ``StepSpan``).
    workflow: str
    instance_id: str
    partition: int
    run_start_ms: int
    traceparent: str | None  # the run's trace (its start's)
    tracestate: str | None
    # The activation.
    version: str
    start_ns: int
    end_ns: int
    first: bool  # it started the run: its span is the run span
    inputs: str  # the inputs' kinds, comma-separated, in order ("StartWorkflow,...")
    command_id: str  # the first command read from the commands log ("" if none)
    offset: int  # its offset in the partition (-1 if none)
    commands: int  # commands read from the log
    status: str  # the instance's status after it
    error_type: str  # how the run failed, if it failed in this activation, else ""
    error_message: str
    stacktrace: str  # the workflow's traceback when it failed here ("" if not known)
    links: tuple[tuple[str, str | None], ...]  # trace contexts inputs carried from elsewhere
    system: str  # ``Messaging``'s fields
    destination: str
    group: str

    @property
    def failed_here(self) -> bool:
        """The run failed in this activation (its span is the error, not a later one)."""
        return self.status == "failed" and bool(self.error_type)


class SpanSink(Protocol):
    def step(self, span: StepSpan) -> None: ...

    def activation(self, span: ActivationSpan) -> None: ...


# A flat span's kind, its first field (``FlatSpanSink``).
FLAT_STEP, FLAT_ACTIVATION = 0, 1


@runtime_checkable
class FlatSpanSink(Protocol):
    """A sink that takes a commit's spans at once, each as a plain tuple of plain values
    (it may be marshalled as it is): its kind (``FLAT_STEP`` or ``FLAT_ACTIVATION``), the
    run's fields as one tuple (``run_fields``: the first ``RUN_FIELDS`` of ``StepSpan``
    and ``ActivationSpan``), then the span's own fields, the ones that are nearly always
    the same folded into one (``flat_step``, ``flat_activation``; ``named`` unfolds them).
    Making and handing over a span costs the engine's thread per value: a run's fields,
    made once and shared, an unfailed span's ``None`` for its three error fields and a
    backend's one messaging tuple are each one value, written once per batch by a
    marshaller that keeps references. The list is handed over: the sink may keep it."""

    def spans_flat(self, spans: list[tuple[object, ...]]) -> None: ...


# A flat step span: FLAT_STEP, run, key, step, attempt, start_ms, end_ms, outcome, failure
# (None, or (error_type, error_message, stacktrace)).
# A flat activation span: FLAT_ACTIVATION, run, version, start_ns, end_ns, first, inputs,
# read (None: no command read from the log, or (command_id, offset, commands)), status,
# failure (as a step's), links, messaging (a plain tuple of ``Messaging``'s fields).
_NO_FAILURE = ("", "", "")
_NO_READ = ("", -1, 0)


def run_fields(state: InstanceState, partition: int) -> tuple[object, ...]:
    """The run's fields of the spans of ``state``'s run (``RUN_FIELDS`` of them), made
    once per run and kept on the state (``InstanceState.span_run``: a span's maker reads
    that first, as ``state.span_run or run_fields(state, partition)``). A new run forgets
    them; a reset or fork folds a new state."""
    fields = state.span_run = (
        state.workflow,
        state.instance_id,
        partition,
        state.created_ms,
        state.traceparent,
        state.tracestate,
    )
    return fields


def named(span: tuple[Any, ...]) -> StepSpan | ActivationSpan:
    """A flat span (``FlatSpanSink``) as its named tuple."""
    run = span[1]
    if span[0] == FLAT_STEP:
        return StepSpan._make((*run, *span[2:8], *(span[8] or _NO_FAILURE)))
    return ActivationSpan._make(
        (
            *run,
            *span[2:7],
            *(span[7] or _NO_READ),
            span[8],
            *(span[9] or _NO_FAILURE),
            span[10],
            *span[11],
        )
    )


def flat_step(span: StepSpan) -> tuple[object, ...]:
    """A step span as a flat one (``FlatSpanSink``)."""
    failure = span[-3:]
    return (
        FLAT_STEP,
        span[:RUN_FIELDS],
        *span[RUN_FIELDS:-3],
        failure if any(failure) else None,
    )


def flat_activation(span: ActivationSpan) -> tuple[object, ...]:
    """An activation span as a flat one (``FlatSpanSink``)."""
    read = (span.command_id, span.offset, span.commands)
    failure = (span.error_type, span.error_message, span.stacktrace)
    return (
        FLAT_ACTIVATION,
        span[:RUN_FIELDS],
        span.version,
        span.start_ns,
        span.end_ns,
        span.first,
        span.inputs,
        None if read == _NO_READ else read,
        span.status,
        failure if any(failure) else None,
        span.links,
        plain_messaging(Messaging(span.system, span.destination, span.group)),
    )


@cache
def plain_messaging(messaging: Messaging) -> tuple[str, str, str]:
    """``messaging``'s fields as one plain tuple (marshal takes no named tuple), the same
    object each time."""
    return (messaging.system, messaging.destination, messaging.group)


_STATUS_TEXT = {status: status.value for status in Status}


class _Activation:
    """The commands and timer fires one instance took in the batch being made, until
    its commit (the step outcomes it took are the batch's own record)."""

    __slots__ = ("command_id", "commands", "first", "inputs", "links", "offset")

    def __init__(self, first_input: str) -> None:
        self.inputs = [first_input]
        self.command_id = ""
        self.offset = -1
        self.commands = 0
        self.links: list[tuple[str, str | None]] | None = None
        self.first = False  # it started the run


class Activations:
    """The commands and fires each instance took in the batch being made, by partition,
    until the batch's commit makes its activation spans. Fed only while traced."""

    def __init__(self) -> None:
        self._pending: dict[int, dict[str, _Activation]] = {}

    def input_applied(
        self, partition: int, record: Command, offset: int, run_traceparent: str | None
    ) -> None:
        """A command (``offset`` >= 0: read from the commands log) or a timer fire took
        effect on its instance, whose run's trace is ``run_traceparent``."""
        pending = self._pending.get(partition)
        if pending is None:
            pending = self._pending[partition] = {}
        activation = pending.get(record.instance_id)
        if activation is None:
            activation = pending[record.instance_id] = _Activation(record.type)
        else:
            activation.inputs.append(record.type)
        if offset >= 0:
            if not activation.commands:
                activation.command_id, activation.offset = record.command_id, offset
            activation.commands += 1
        carried = record.traceparent
        if carried and carried != run_traceparent and not isinstance(record, StartWorkflow):
            if activation.links is None:
                activation.links = []
            activation.links.append((carried, record.tracestate))

    def take(self, partition: int) -> dict[str, _Activation]:
        """The partition's activations of the batch being committed (forgotten here)."""
        return self._pending.pop(partition, {})

    @staticmethod
    def spans(
        partition: int,
        taken: Mapping[str, _Activation],
        outcomes: Mapping[str, Sized],
        began_ns: int,
        touched: Mapping[str, InstanceRuntime],
        messaging: Messaging,
        run_tracebacks: Mapping[str, str],
        out: list[tuple[object, ...]],
    ) -> None:
        """Append to ``out`` a flat activation span (``FlatSpanSink``) for each instance
        the commit drove with inputs: the commands and fires ``taken`` holds, then the
        step outcomes ``outcomes`` holds (the order the batch applied them in), from
        ``began_ns`` to now. A run that failed in it has the traceback
        ``run_tracebacks`` holds for it."""
        end_ns = time.time_ns()
        plain = plain_messaging(messaging)
        for instance_id in taken.keys() | outcomes.keys() if taken else outcomes:
            runtime = touched.get(instance_id)
            if runtime is None or not runtime.state.workflow:
                continue  # not driven (its inputs were undone), or no run to speak of
            state = runtime.state
            activation = taken.get(instance_id) if taken else None
            applied = outcomes.get(instance_id)
            steps = len(applied) if applied is not None else 0
            links: tuple[tuple[str, str | None], ...] = ()
            read: tuple[str, int, int] | None = None
            if activation is None:
                inputs = _outcomes(steps)
                first = False
            else:
                inputs = ",".join(activation.inputs)
                if steps:
                    inputs += "," + _outcomes(steps)
                first = activation.first
                if activation.commands:
                    read = (activation.command_id, activation.offset, activation.commands)
                links = tuple(activation.links) if activation.links else ()
            out.append(
                (
                    FLAT_ACTIVATION,
                    state.span_run or run_fields(state, partition),
                    state.version,
                    # The run span begins with the run (its id is derived from that ms),
                    # never before, though its batch may have begun a moment earlier.
                    min(max(began_ns, state.created_ms * 1_000_000), end_ns) if first else began_ns,
                    end_ns,
                    first,
                    inputs,
                    read,
                    _STATUS_TEXT[state.status],  # a plain str: the batch is marshalled
                    (
                        (
                            state.error_type,
                            state.error_message,
                            run_tracebacks.get(instance_id, ""),
                        )
                        # Only the activation that failed the run: a later one (the
                        # outcome of a step the failure left running) is not an error.
                        if state.status is Status.FAILED and instance_id in run_tracebacks
                        else None
                    ),
                    links,
                    plain,
                )
            )


@cache
def _outcomes(count: int) -> str:
    """The inputs of ``count`` step outcomes, as an activation span lists them."""
    return ",".join(["StepOutcome"] * count)
