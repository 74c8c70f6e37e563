"""What the engine counts and measures while it runs, for metrics and traces.

One ``Telemetry`` per process (the host's), shared by every partition it owns, so its
counters stay monotonic across rebalances. The hot path only bumps plain counters and
bucket arrays here; ``ops/telemetry/metrics.py`` turns them into Prometheus families when scraped,
and an optional ``SpanSink`` (``ops/telemetry/tracing.py``) turns each activation of a run
and each finished step attempt into a span (``consumers/spans.py``). Both are fed from
records once they are durable, so they count what happened, once, whichever worker saw
it happen. Only while traced does the processor report the commands and fires it
applies (``input_applied``; the step outcomes are the batch's own record): untraced,
spans cost nothing.

Labels are bounded: a workflow name, a step name (the name the code gave, without the
scope path or the ``#n`` of a repeated name), an outcome, a partition. Never an
instance id.

Failures are logged from here too (``consumers/failure_log.py``): once, when durable.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Mapping, Sequence, Sized
from typing import TYPE_CHECKING, cast

from stepstream.consumers import failure_log
from stepstream.consumers.queue_telemetry import QueueTelemetry
from stepstream.consumers.spans import (
    FLAT_STEP,
    IN_PROCESS,
    Activations,
    FlatSpanSink,
    SpanSink,
    StepSpan,
    named,
    run_fields,
)
from stepstream.engine.api.queues import QUEUE_INSTANCE_PREFIX
from stepstream.engine.replay.core import WORKFLOW_TRACEBACK
from stepstream.engine.wire.records import (
    HistoryRecord,
    StepAttemptStarted,
    StepFailedRecord,
    StepSucceeded,
    WorkflowCancelledRecord,
    WorkflowCompleted,
    WorkflowFailedRecord,
    WorkflowStarted,
    WorkflowTerminatedRecord,
)

if TYPE_CHECKING:
    from stepstream.engine.replay.effects import StepLaunch
    from stepstream.engine.replay.runtime import InstanceRuntime

LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    1800.0,
)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class Histogram:
    """Cumulative-on-read bucket counts, a sum and a count (Prometheus semantics)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), ending with +Inf."""
        out: list[tuple[float, int]] = []
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


_RUN_ENDS = frozenset(
    (WorkflowCompleted, WorkflowFailedRecord, WorkflowCancelledRecord, WorkflowTerminatedRecord)
)
RunEnd = (
    WorkflowCompleted | WorkflowFailedRecord | WorkflowCancelledRecord | WorkflowTerminatedRecord
)
_LABELS: dict[str, str] = {}  # step key -> label, for the keys seen most recently
_LABELS_KEPT = 10_000


def step_label(key: str) -> str:
    """The step's own name for a label: ``join/a/charge#2`` -> ``charge``; a saga's
    compensation ``charge#2/undo`` -> ``charge/undo``."""
    label = _LABELS.get(key)
    if label is None:
        if len(_LABELS) >= _LABELS_KEPT:
            _LABELS.clear()
        label = _LABELS[key] = _step_label(key)
    return label


def _step_label(key: str) -> str:
    parts = key.split("/")
    if len(parts) > 1 and parts[-1] == "undo":
        return parts[-2].split("#", 1)[0] + "/undo"
    return parts[-1].split("#", 1)[0]


def step_outcome(record: StepSucceeded | StepFailedRecord) -> str:
    if isinstance(record, StepSucceeded):
        return "succeeded"
    if record.error_type == "AttemptCancelled":
        return "cancelled"
    if record.next_attempt_at_ms is None:
        return "failed"  # the step gave up, a last attempt's timeout too: what alerts count
    return "timed_out" if record.error_type == "StepTimeout" else "retried"


# What a dead letter's reason says (lower case) -> its label, first match wins.
_DEAD_LETTER_NEEDLES = (
    ("is set apart", "set_apart"),  # first: the reason it quotes may name any other
    ("undecodable", "undecodable"),
    ("misrouted", "misrouted"),
    ("is not a command", "not_a_command"),
    ("internal error", "internal_error"),
    ("not applied:", "undone"),
    ("unknown instance", "unknown_instance"),
    ("no instance", "unknown_instance"),
    ("unknown workflow", "unknown_workflow"),
    ("payloadtoolarge", "payload_too_large"),
    ("invalidpayload", "invalid_payload"),
    ("historydiverged", "history_diverged"),
)
# Every label, exported from the start (at 0): an alert on the counter's increase sees
# the first dead letter of a reason, which a series born at 1 would not show.
DEAD_LETTER_REASONS = (*dict.fromkeys(label for _, label in _DEAD_LETTER_NEEDLES), "other")


def dead_letter_reason(reason: str) -> str:
    """A bounded label for why a record was dead-lettered."""
    lowered = reason.lower()
    for needle, label in _DEAD_LETTER_NEEDLES:
        if needle in lowered:
            return label
    return "other"


class Telemetry:
    def __init__(self) -> None:
        self.commands: Counter[str] = Counter()  # command type -> applied
        self.workflows: Counter[tuple[str, str]] = Counter()  # (workflow, outcome)
        self.steps: Counter[tuple[str, str, str]] = Counter()  # (workflow, step, outcome)
        self.step_seconds: dict[tuple[str, str], Histogram] = {}
        self.workflow_seconds: dict[tuple[str, str], Histogram] = {}
        self.timer_lateness = Histogram(LATENCY_BUCKETS_S)
        # Timer fires applied, by path: "direct" (handed over by the partition's timer
        # service) or "log" (through the commands topic).
        self.timers_fired: Counter[str] = Counter()
        self.commit_records = Histogram(BATCH_BUCKETS)
        self.commit_seconds = Histogram(LATENCY_BUCKETS_S)
        self.replay_seconds = Histogram(LATENCY_BUCKETS_S)
        self.restore_seconds: dict[int, float] = {}
        # Schedule-to-start: a start command's acceptance to its instance's start, by
        # workflow; a step attempt becoming due to its launch, by (workflow, step).
        self.start_delay_seconds: dict[str, Histogram] = {}
        self.step_delay_seconds: dict[tuple[str, str], Histogram] = {}
        self.dead_letters: Counter[str] = Counter()
        # Instances set apart because what they decided could not be stored.
        self.set_apart = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.rebalances = 0
        self.queues = QueueTelemetry(lambda: Histogram(LATENCY_BUCKETS_S))
        self._spans: SpanSink | None = None
        self._flat: FlatSpanSink | None = None
        self.messaging = IN_PROCESS  # the backend's, set by whoever assembles it
        # Only while traced: the inputs each instance took in the batch being made.
        self.activations = Activations()
        # When each running attempt was durably started:
        # partition -> instance -> key -> (attempt, ms).
        self._started: dict[int, dict[str, dict[str, tuple[int, int]]]] = {}

    @property
    def spans(self) -> SpanSink | None:
        """Where activations of runs and finished step attempts go as spans (None: not
        traced)."""
        return self._spans

    @spans.setter
    def spans(self, sink: SpanSink | None) -> None:
        self._spans = sink
        self._flat = sink if isinstance(sink, FlatSpanSink) else None

    @property
    def traced(self) -> bool:
        """Whether spans are made (then the processor reports each input it applies)."""
        return self._spans is not None

    def command_applied(self, kind: str) -> None:
        self.commands[kind] += 1

    def timer_fired(self, lateness_s: float, *, direct: bool) -> None:
        self.timer_lateness.observe(lateness_s)
        self.timers_fired["direct" if direct else "log"] += 1

    def instance_started(self, workflow: str, accepted_ms: int, now_ms: int) -> None:
        """A start command made a new instance: how long after its client stamped it
        (``accepted_ms``; 0 from a producer that does not stamp it: not counted)."""
        if accepted_ms <= 0:
            return
        histogram = self.start_delay_seconds.get(workflow)
        if histogram is None:
            histogram = self.start_delay_seconds[workflow] = Histogram(LATENCY_BUCKETS_S)
        # Clamped: a client's clock may run ahead of the worker's.
        histogram.observe(max(0, now_ms - accepted_ms) / 1000)

    def steps_launched(self, launches: Sequence[StepLaunch], began_ms: int, now_ms: int) -> None:
        """Step attempts handed to the executor at ``now_ms``, each after it was due: a
        retry when its backoff ended (``due_ms``), a first attempt when the batch that
        decided it began (``began_ms``). One call per commit, not per step; the first
        attempts of a commit share their latency, so its bucket is found once."""
        delays = self.step_delay_seconds
        first = (now_ms - began_ms) / 1000 if now_ms > began_ms else 0.0
        first_at = bisect_left(LATENCY_BUCKETS_S, first)
        for launch in launches:
            label = (launch.workflow, step_label(launch.key))
            histogram = delays.get(label)
            if histogram is None:
                histogram = delays[label] = Histogram(LATENCY_BUCKETS_S)
            if launch.due_ms:
                histogram.observe(max(0, now_ms - launch.due_ms) / 1000)
            else:
                histogram.counts[first_at] += 1
                histogram.sum += first

    def dead_lettered(self, reason: str) -> None:
        self.dead_letters[dead_letter_reason(reason)] += 1

    def quarantined(self, partition: int) -> None:
        self.set_apart += 1

    def committed(
        self,
        partition: int,
        history: Sequence[HistoryRecord],
        touched: Mapping[str, InstanceRuntime],
        *,
        records: int,
        seconds: float,
        outcomes: Mapping[str, Sized],
        began_ns: int,
    ) -> None:
        """Count what a durable commit recorded. Traced, make its spans: its step
        attempts that ended, and an activation of each instance it applied inputs to
        (``outcomes``: the step outcomes each took; its batch began at ``began_ns``)."""
        self.commit_records.observe(records)
        self.commit_seconds.observe(seconds)
        for runtime in touched.values():
            if runtime.replayed_s is not None:
                self.replay_seconds.observe(runtime.replayed_s)
                runtime.replayed_s = None
        started = self._started.get(partition)
        if started is None:
            started = self._started[partition] = {}
        traced = self._spans is not None
        activations = self.activations.take(partition) if traced else {}
        spans: list[tuple[object, ...]] | None = [] if traced else None
        run_tracebacks: dict[str, str] = {}
        # Checked per instance, not per record: most commits touch no queue.
        queues = [i for i in touched if i[:1] == "~" and i.startswith(QUEUE_INSTANCE_PREFIX)]
        for record in history:  # by exact type: every record of every commit passes here
            kind = type(record)
            if queues and record.instance_id in queues:
                self.queues.recorded(partition, record, touched.get(record.instance_id))
            if kind is StepAttemptStarted:
                attempt = cast(StepAttemptStarted, record)
                attempts = started.get(record.instance_id)
                if attempts is None:
                    attempts = started[record.instance_id] = {}
                attempts[attempt.key] = (attempt.attempt, record.time_ms)
            elif kind is StepSucceeded or kind is StepFailedRecord:
                ended = cast("StepSucceeded | StepFailedRecord", record)
                owner = touched.get(record.instance_id)
                traceback = ""
                if kind is StepFailedRecord:
                    if owner is not None and self._spans is not None:  # before the log takes it
                        traceback = owner.tracebacks.get((ended.key, ended.attempt), "")
                    failure_log.step_failed(partition, cast(StepFailedRecord, record), owner)
                attempts = started.get(record.instance_id)
                began = attempts.pop(ended.key, None) if attempts is not None else None
                self._step_ended(partition, ended, owner, began, traceback, spans)
            elif kind is WorkflowStarted:
                self.workflows[(cast(WorkflowStarted, record).workflow, "started")] += 1
                if record.instance_id in activations:
                    activations[record.instance_id].first = True
            elif kind in _RUN_ENDS:
                end = cast("RunEnd", record)
                owner = touched.get(record.instance_id)
                # Attempts begun here that the run's end gave up: no outcome will come.
                left = started.pop(record.instance_id, None)
                given_up = sorted((key, a) for key, (a, _) in left.items()) if left else []
                for key, number in given_up:
                    workflow = owner.state.workflow if owner is not None else ""
                    step = step_label(key)
                    self.steps[(workflow, step, "cancelled")] += 1
                    if spans is not None and owner is not None and left:
                        # Its span too, ended with the run: no outcome will come.
                        times = (left[key][1], record.time_ms)
                        span = _step_span(owner, partition, (key, step), number, times, "cancelled")
                        spans.append(span)
                if kind is WorkflowCancelledRecord or kind is WorkflowTerminatedRecord:
                    stopped = cast("WorkflowCancelledRecord | WorkflowTerminatedRecord", record)
                    failure_log.run_stopped(partition, stopped, owner, given_up)
                if kind is WorkflowFailedRecord:
                    if owner is not None and traced:  # before the log takes it
                        run_tracebacks[record.instance_id] = owner.tracebacks.get(
                            WORKFLOW_TRACEBACK, ""
                        )
                    failure_log.run_failed(partition, cast(WorkflowFailedRecord, record), owner)
                self._run_ended(end, owner)
        if spans is not None:
            self.activations.spans(
                partition,
                activations,
                outcomes,
                began_ns,
                touched,
                self.messaging,
                run_tracebacks,
                spans,
            )
            if not spans:
                return
            if self._flat is not None:
                self._flat.spans_flat(spans)
                return
            sink = self._spans
            assert sink is not None
            for flat in spans:
                span = named(flat)
                if isinstance(span, StepSpan):
                    sink.step(span)
                else:
                    sink.activation(span)

    def _step_ended(
        self,
        partition: int,
        record: StepSucceeded | StepFailedRecord,
        runtime: InstanceRuntime | None,
        started: tuple[int, int] | None,
        traceback: str,
        spans: list[tuple[object, ...]] | None,
    ) -> None:
        workflow = runtime.state.workflow if runtime is not None else ""
        step = step_label(record.key)
        outcome = step_outcome(record)
        self.steps[(workflow, step, outcome)] += 1
        if started is None or started[0] != record.attempt:
            return  # started before this process owned the partition: no duration here
        seconds = max(0.0, (record.time_ms - started[1]) / 1000)
        histogram = self.step_seconds.get((workflow, step))
        if histogram is None:
            histogram = self.step_seconds[(workflow, step)] = Histogram(LATENCY_BUCKETS_S)
        histogram.observe(seconds)
        if spans is not None and runtime is not None:
            error = (
                (record.error_type, record.error_message, traceback)
                if isinstance(record, StepFailedRecord)
                else None
            )
            times = (started[1], record.time_ms)
            spans.append(
                _step_span(
                    runtime, partition, (record.key, step), record.attempt, times, outcome, error
                )
            )

    def _run_ended(
        self,
        record: RunEnd,
        runtime: InstanceRuntime | None,
    ) -> None:
        if runtime is None:
            return
        state = runtime.state
        outcome = {
            WorkflowCompleted: "completed",
            WorkflowFailedRecord: "failed",
            WorkflowCancelledRecord: "cancelled",
            WorkflowTerminatedRecord: "terminated",
        }[type(record)]
        self.workflows[(state.workflow, outcome)] += 1
        seconds = max(0.0, (record.time_ms - state.created_ms) / 1000)
        histogram = self.workflow_seconds.get((state.workflow, outcome))
        if histogram is None:
            histogram = Histogram(LATENCY_BUCKETS_S)
            self.workflow_seconds[(state.workflow, outcome)] = histogram
        histogram.observe(seconds)

    def partition_released(self, partition: int) -> None:
        """The partition is no longer owned here: forget its attempts' start times, and
        its last restore's duration (its new owner reports that)."""
        self._started.pop(partition, None)
        self.activations.take(partition)
        self.restore_seconds.pop(partition, None)
        self.queues.partition_released(partition)


def _step_span(
    runtime: InstanceRuntime,
    partition: int,
    named: tuple[str, str],
    attempt: int,
    times_ms: tuple[int, int],
    outcome: str,
    error: tuple[str, str, str] | None = None,
) -> tuple[object, ...]:
    """A flat step span (``FlatSpanSink``): ``StepSpan``'s fields after the run's, for the
    attempt of step ``named`` (its key, and its label) from start to end ``times_ms``."""
    run = runtime.state.span_run or run_fields(runtime.state, partition)
    return (FLAT_STEP, run, *named, attempt, *times_ms, outcome, error)
