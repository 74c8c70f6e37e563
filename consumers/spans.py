"""The spans the engine hands to a ``SpanSink``: plain tuples made on the hot path
(``consumers/telemetry.py``), turned into OpenTelemetry spans elsewhere
(``ops/telemetry/``), often in another process; and ``Activations``, what an activation
span is made of while its batch is built."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from stepstream.engine.replay.status import Status
from stepstream.engine.wire.records import Command, StartWorkflow

if TYPE_CHECKING:
    from stepstream.engine.replay.runtime import InstanceRuntime


class StepSpan(NamedTuple):
    """One step attempt that ended, as a span: from its durable start to its outcome."""

    workflow: str
    instance_id: str
    partition: int
    key: str
    step: str
    attempt: int
    start_ms: int
    end_ms: int
    outcome: str
    error_type: str
    error_message: str
    traceparent: str | None
    tracestate: str | None
    run_start_ms: int  # the run's start: names the run span the attempt belongs to
    stacktrace: str  # the body's traceback when it raised here ("" if not known)


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

    workflow: str
    version: str
    instance_id: str
    partition: int
    start_ns: int
    end_ns: int
    run_start_ms: int
    first: bool  # it started the run: its span is the run span
    inputs: str  # the inputs' kinds, comma-separated, in order ("StartWorkflow,...")
    command_id: str  # the first command read from the commands log ("" if none)
    offset: int  # its offset in the partition (-1 if none)
    commands: int  # commands read from the log
    status: str  # the instance's status after it
    error_type: str  # how the run failed (status "failed"), else ""
    error_message: str
    stacktrace: str  # the workflow's traceback when it failed here ("" if not known)
    traceparent: str | None  # the run's trace (its start's)
    tracestate: str | None
    links: tuple[tuple[str, str | None], ...]  # trace contexts inputs carried from elsewhere
    system: str  # ``Messaging``'s fields
    destination: str
    group: str


class SpanSink(Protocol):
    def step(self, span: StepSpan) -> None: ...

    def activation(self, span: ActivationSpan) -> None: ...


@runtime_checkable
class FlatSpanSink(Protocol):
    """A sink that takes spans as plain tuples of ``StepSpan``'s or ``ActivationSpan``'s
    fields, in order: making the named tuple is most of what a span costs the engine's
    thread (1.3 of 1.5 µs for a step span)."""

    def step_flat(self, fields: tuple[object, ...]) -> None: ...

    def activation_flat(self, fields: tuple[object, ...]) -> None: ...


_STATUS_TEXT = {status: status.value for status in Status}


class _Activation:
    """The inputs of one instance applied in the batch being made, until its commit."""

    __slots__ = ("command_id", "commands", "first", "inputs", "links", "offset")

    def __init__(self, first_input: str) -> None:
        self.inputs = [first_input]
        self.command_id = ""
        self.offset = -1
        self.commands = 0
        self.links: list[tuple[str, str | None]] | None = None
        self.first = False  # it started the run


class _Pending(dict[str, _Activation]):
    """A partition's activations of the batch being made, and when its first input was
    applied: where every activation of the batch starts (the inputs of one batch are
    applied in one go, milliseconds apart, so a clock read per activation says no more)."""

    __slots__ = ("began_ns",)

    def __init__(self) -> None:
        super().__init__()
        self.began_ns = time.time_ns()


class Activations:
    """The inputs each instance took in the batch being made, by partition, until the
    batch's commit makes them activation spans. Fed only while traced."""

    def __init__(self) -> None:
        self._pending: dict[int, _Pending] = {}

    def input_applied(
        self, partition: int, record: Command, offset: int, run_traceparent: str | None
    ) -> None:
        """A command (``offset`` >= 0: read from the commands log) or a timer fire took
        effect on its instance, whose run's trace is ``run_traceparent``."""
        pending = self._pending.get(partition)
        if pending is None:
            pending = self._pending[partition] = _Pending()
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

    def outcome_applied(self, partition: int, instance_id: str) -> None:
        """A step attempt's outcome was applied to its instance (on every step outcome
        of a traced engine: kept short)."""
        pending = self._pending.get(partition)
        if pending is None:
            pending = self._pending[partition] = _Pending()
        activation = pending.get(instance_id)
        if activation is None:
            pending[instance_id] = _Activation("StepOutcome")
        else:
            activation.inputs.append("StepOutcome")

    def take(self, partition: int) -> _Pending | None:
        """The partition's activations of the batch being committed (forgotten here)."""
        return self._pending.pop(partition, None)

    @staticmethod
    def spans(
        partition: int,
        taken: _Pending,
        touched: Mapping[str, InstanceRuntime],
        messaging: Messaging,
        run_tracebacks: Mapping[str, str],
    ) -> Iterator[tuple[object, ...]]:
        """An activation span's fields (``ActivationSpan``'s, in order) for each
        instance the commit drove with inputs; a run that failed in it has the traceback
        ``run_tracebacks`` holds for it."""
        began_ns, end_ns = taken.began_ns, time.time_ns()
        system, destination, group = messaging
        for instance_id, activation in taken.items():
            runtime = touched.get(instance_id)
            if runtime is None or not runtime.state.workflow:
                continue  # not driven (its inputs were undone), or no run to speak of
            state = runtime.state
            failed = state.status is Status.FAILED
            yield (
                state.workflow,
                state.version,
                instance_id,
                partition,
                began_ns,
                end_ns,
                state.created_ms,
                activation.first,
                ",".join(activation.inputs),
                activation.command_id,
                activation.offset,
                activation.commands,
                _STATUS_TEXT[state.status],  # a plain str: the batch is marshalled
                state.error_type if failed else "",
                state.error_message if failed else "",
                run_tracebacks.get(instance_id, "") if failed else "",
                state.traceparent,
                state.tracestate,
                tuple(activation.links) if activation.links else (),
                system,
                destination,
                group,
            )
