"""The spans the engine hands to a ``SpanSink``: plain tuples made on the hot path
(``consumers/telemetry.py``), turned into OpenTelemetry spans elsewhere
(``ops/telemetry/``), often in another process."""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable


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
    it (commands, timer fires, step outcomes), from the first of them to the commit. The
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
class FlatStepSink(Protocol):
    """A sink that takes a step span as a plain tuple of ``StepSpan``'s fields, in order:
    making the named tuple is most of what a span costs the engine's thread (1.3 of
    1.5 µs)."""

    def step_flat(self, fields: tuple[object, ...]) -> None: ...
