"""The crash checker's verdict: folds a raw history log and checks design.md's guarantees.

Pure functions over what a run left behind, for ``tests/faults/test_crash_checker.py``:

- ``fold(history)``: the history log (every partition, in offset order, as any Kafka
  tool reads it) folded by the reader rules of schemas/README.md: the highest
  ``PartitionFenced`` epoch so far wins, records of lower epochs after it are skipped,
  as are re-deliveries (a seq not above the last one applied for the instance).
- ``check_run(...)``: every instance's folded story against its plan
  (``tests.crash_workflows``), the commands on the commands log, the commands the
  workload's client saw acknowledged, the step ledger and what the engine serves.

Each check appends a problem (a sentence) to the instance it concerns; the test fails
with the seed, each such instance's problems, story, commands and ledger.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field, fields
from typing import Any

from stepstream.engine.replay.ids import is_client_command
from stepstream.engine.wire.records import (
    CancelWorkflow,
    Command,
    CommandIgnored,
    EventBuffered,
    HistoryRecord,
    InstanceForgotten,
    PartitionFenced,
    PauseWorkflow,
    Payload,
    Record,
    ResumeWorkflow,
    SendEvent,
    SleepElapsed,
    SleepStarted,
    StartWorkflow,
    StepAttemptStarted,
    StepFailedRecord,
    StepSucceeded,
    WaitSatisfied,
    WaitStarted,
    WaitTimedOut,
    WorkflowCancelledRecord,
    WorkflowCompleted,
    WorkflowFailedRecord,
    WorkflowPaused,
    WorkflowResumed,
    WorkflowStarted,
)
from stepstream.engine.wire.topics import partition_for

LOST = "AttemptLost"  # the error type of an attempt lost with its worker
TERMINAL = (WorkflowCompleted, WorkflowFailedRecord, WorkflowCancelledRecord)
# Records only running workflow code makes: none while an instance is paused. (What
# happens to it meanwhile is recorded: a running attempt's outcome, a timer, an event
# that a pending wait claims; the code moves on only once resumed.)
CODE_DRIVEN = (
    "StepAttemptStarted",
    "SleepStarted",
    "WaitStarted",
    "ValueRecorded",
    "AttributesSet",
)
# The record that applying each type of client command makes (or CommandIgnored).
APPLIES: dict[type[HistoryRecord], str] = {
    WorkflowStarted: StartWorkflow.__name__,
    EventBuffered: SendEvent.__name__,
    WaitSatisfied: SendEvent.__name__,
    WorkflowCancelledRecord: CancelWorkflow.__name__,
    WorkflowPaused: PauseWorkflow.__name__,
    WorkflowResumed: ResumeWorkflow.__name__,
}


def _eid(payload: Payload) -> Any:
    value = plain(payload)
    return value.get("eid") if isinstance(value, dict) else None


@dataclass(frozen=True, slots=True)
class Logged:
    """One record where a log holds it."""

    partition: int
    offset: int
    record: Record


@dataclass(frozen=True, slots=True)
class Sent:
    """One command the workload's client sent, and how the call returned."""

    kind: str  # start | event | cancel | pause | resume
    instance: str
    ident: str = ""  # the event's unique id, the cancel's unique reason
    name: str = ""  # the event's name
    acked: bool = False
    error: str = ""
    at: float = 0.0
    at_ms: int = 0  # the wall clock when the call began (0: not known)


@dataclass
class Folded:
    """A history log folded by the reader rules."""

    stories: dict[str, list[HistoryRecord]] = field(default_factory=dict)
    stale: list[Logged] = field(default_factory=list)  # below the fence: skipped
    redelivered: list[Logged] = field(default_factory=list)  # seq already applied: skipped
    fences: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # (offset, epoch)
    problems: list[str] = field(default_factory=list)  # not about one instance

    @property
    def accepted(self) -> int:
        return sum(len(s) for s in self.stories.values())


def fold(history: list[Logged], partitions: int) -> Folded:
    out = Folded()
    fence: dict[int, int] = {}
    for logged in sorted(history, key=lambda x: (x.partition, x.offset)):
        rec = logged.record
        if not isinstance(rec, HistoryRecord):
            out.problems.append(f"{logged}: a {rec.type} on the history log")
            continue
        if isinstance(rec, PartitionFenced):
            out.fences.setdefault(logged.partition, []).append((logged.offset, rec.epoch))
            if rec.partition != logged.partition:
                out.problems.append(f"fence for partition {rec.partition} on {logged.partition}")
            fence[logged.partition] = max(fence.get(logged.partition, 0), rec.epoch)
            continue
        current = fence.get(logged.partition, 0)
        if rec.epoch < current:
            out.stale.append(logged)
            continue
        if rec.epoch > current:
            out.problems.append(
                f"p{logged.partition}@{logged.offset}: {rec.type} of {rec.instance_id} seq "
                f"{rec.seq} has epoch {rec.epoch} above the partition's fence {current}: "
                "written before its writer fenced the partition"
            )
        if partition_for(rec.instance_id, partitions) != logged.partition:
            out.problems.append(f"{rec.instance_id} seq {rec.seq} on partition {logged.partition}")
        story = out.stories.setdefault(rec.instance_id, [])
        if story and rec.seq <= story[-1].seq:
            out.redelivered.append(logged)
            continue
        if isinstance(rec, InstanceForgotten):
            story.clear()
            continue
        story.append(rec)
    return out


# ---- rendering --------------------------------------------------------------------------


def plain(value: Any) -> Any:
    if isinstance(value, Payload):
        try:
            return json.loads(value.data)
        except ValueError:
            return value.data
    return value


_ENVELOPE = {"instance_id", "seq", "time_ms", "command_id", "epoch", "traceparent", "tracestate"}


def attrs(record: Record) -> dict[str, Any]:
    return {
        f.name: plain(getattr(record, f.name)) for f in fields(record) if f.name not in _ENVELOPE
    }


def render_record(rec: Record) -> str:
    return (
        f"{rec.seq:4d} e{rec.epoch} t{rec.time_ms % 1_000_000:06d} {rec.type:<18} "
        f"{rec.command_id[:14]:<14} {attrs(rec)}"
    )


# ---- the verdict ------------------------------------------------------------------------


@dataclass
class Verdict:
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    transitions: int = 0  # accepted history records checked
    body_runs: int = 0
    crossed: int = 0  # instances whose story was written by more than one owner (epoch)
    lost_attempts: int = 0  # attempts recorded as lost with their worker

    def add(self, instance: str, problem: str) -> None:
        self.problems[instance].append(problem)


@dataclass
class Run:
    """What one run left behind, for ``check_run``."""

    plans: dict[str, dict[str, Any]]
    folded: Folded
    # The commands log, where it keeps every command (Kafka); None where consumed
    # commands are dropped (the embedded log): the story alone names them then.
    commands: list[Logged] | None
    sent: list[Sent]
    ledger: dict[str, list[tuple[str, int, int, str, float]]]
    served: dict[str, list[tuple[int, str, str]]]  # (seq, type, command_id) per instance
    status: dict[str, tuple[str, list[tuple[str, str]]]]  # status, waits (kind, key)
    dead_letters: int


def step_ops(plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    steps: dict[str, dict[str, Any]] = {}
    for op in plan["ops"]:
        if op["op"] == "step":
            steps[op["key"]] = op
        elif op["op"] == "gather":
            steps.update((s["key"], s) for s in op["steps"])
    return steps


def check_run(run: Run) -> Verdict:
    verdict = Verdict()
    for problem in run.folded.problems:
        verdict.add("(log)", problem)
    if run.dead_letters:
        verdict.add("(log)", f"{run.dead_letters} dead letters")
    commands: dict[str, dict[str, Command]] = defaultdict(dict)  # instance -> id -> command
    log_order: dict[str, dict[str, int]] = defaultdict(dict)  # instance -> id -> position
    for logged in run.commands or []:
        rec = logged.record
        if isinstance(rec, Command):
            log_order[rec.instance_id].setdefault(rec.command_id, len(log_order[rec.instance_id]))
            if is_client_command(rec.command_id):
                commands[rec.instance_id].setdefault(rec.command_id, rec)
    sent: dict[str, list[Sent]] = defaultdict(list)
    for s in run.sent:
        sent[s.instance].append(s)
    for instance in sorted(set(run.plans) | set(run.folded.stories)):
        story = run.folded.stories.get(instance, [])
        verdict.transitions += len(story)
        if instance not in run.plans:
            verdict.add(instance, "a story for an instance the workload never started")
            continue
        check = _InstanceCheck(
            instance,
            run.plans[instance],
            story,
            None if run.commands is None else commands.get(instance, {}),
            log_order.get(instance, {}),
            sent.get(instance, []),
            run.ledger.get(instance, []),
            verdict,
        )
        check.run()
        verdict.body_runs += sum(1 for line in check.ledger if line[3] == "start")
        verdict.crossed += len({r.epoch for r in story}) > 1
        verdict.lost_attempts += sum(
            1 for r in story if isinstance(r, StepFailedRecord) and r.error_type == LOST
        )
        served = run.served.get(instance)
        folded = [(r.seq, r.type, r.command_id) for r in story]
        if served is not None and served != folded:
            verdict.add(
                instance,
                f"the engine serves a history that differs from the log's fold: {served}",
            )
        if instance in run.status:
            check.final_status(*run.status[instance])
    return verdict


class _InstanceCheck:
    def __init__(
        self,
        instance: str,
        plan: dict[str, Any],
        story: list[HistoryRecord],
        commands_log: dict[str, Command] | None,
        log_order: dict[str, int],
        sent: list[Sent],
        ledger: list[tuple[str, int, int, str, float]],
        verdict: Verdict,
    ) -> None:
        self.instance = instance
        self.plan = plan
        self.story = story
        self.commands_log = commands_log
        self.log_order = log_order  # every command of the instance (timer fires too)
        self.commands_applied: dict[str, tuple[str, list[HistoryRecord]]] = {}
        self.sent = sent
        self.ledger = ledger
        self.verdict = verdict

    def bad(self, problem: str) -> None:
        self.verdict.add(self.instance, problem)

    def run(self) -> None:
        if not self.story:
            if any(s.kind == "start" and s.acked for s in self.sent):
                self.bad("its start was acknowledged but the log has no story")
            return
        self.commands_applied = self.applied()
        self.lifecycle()
        self.steps()
        self.sleeps_and_waits()
        self.paused_spans()
        self.commands_applied_once()
        self.events_in_order()
        self.acknowledged()
        self.body_runs()
        self.outcome()

    # ---- the story on its own -----------------------------------------------------------

    def lifecycle(self) -> None:
        seqs = [r.seq for r in self.story]
        if seqs != list(range(1, len(seqs) + 1)):
            self.bad(f"seqs are not 1..{len(seqs)} without gaps or repeats: {seqs}")
        if not isinstance(self.story[0], WorkflowStarted):
            self.bad(f"the story starts with {self.story[0].type}")
        started = [r for r in self.story if isinstance(r, WorkflowStarted)]
        if len(started) != 1:
            self.bad(f"{len(started)} WorkflowStarted records")
        ends = [i for i, r in enumerate(self.story) if isinstance(r, TERMINAL)]
        if len(ends) > 1:
            self.bad(f"{len(ends)} terminal records")
        if ends:
            after = [r.type for r in self.story[ends[0] + 1 :] if not isinstance(r, CommandIgnored)]
            if after:
                self.bad(f"transitions after the end: {after}")
        failed = [r for r in self.story if isinstance(r, WorkflowFailedRecord)]
        if failed:
            self.bad(f"the workflow failed: {attrs(failed[0])}")

    def steps(self) -> None:
        plan_steps = step_ops(self.plan)
        by_key: dict[str, list[HistoryRecord]] = defaultdict(list)
        for r in self.story:
            if isinstance(r, (StepAttemptStarted, StepSucceeded, StepFailedRecord)):
                by_key[r.key].append(r)
        for key, records in by_key.items():
            op = plan_steps.get(key)
            if op is None:
                self.bad(f"a step {key!r} that the plan does not have")
                continue
            self._step(key, op, records)

    def _step(self, key: str, op: dict[str, Any], records: list[HistoryRecord]) -> None:
        maximum, fail = op["max"], op["fail"]
        expected_attempt = 1
        running: StepAttemptStarted | None = None
        retry_at: int | None = None
        settled = False
        for r in records:
            if settled:
                self.bad(f"step {key}: {r.type} (attempt {r.attempt}) after the step settled")
                continue
            if isinstance(r, StepAttemptStarted):
                if running is not None:
                    self.bad(f"step {key}: attempt {r.attempt} began while {running.attempt} ran")
                if r.attempt != expected_attempt:
                    self.bad(f"step {key}: attempt {r.attempt} began, expected {expected_attempt}")
                if r.attempt > maximum or r.max_attempts != maximum:
                    self.bad(
                        f"step {key}: attempt {r.attempt} of max_attempts {r.max_attempts}, "
                        f"the policy allows {maximum}"
                    )
                if retry_at is not None and r.time_ms < retry_at:
                    self.bad(
                        f"step {key}: attempt {r.attempt} began {retry_at - r.time_ms} ms "
                        "before its backoff ended"
                    )
                running, retry_at = r, None
                expected_attempt = r.attempt + 1
                continue
            if running is None or r.attempt != running.attempt:
                self.bad(f"step {key}: {r.type} of attempt {r.attempt}, which was not running")
                continue
            running = None
            if isinstance(r, StepSucceeded):
                settled = True
                if r.attempt <= fail:
                    self.bad(f"step {key}: attempt {r.attempt} succeeded, its body always fails")
                if plain(r.result) != {"key": key, "attempt": r.attempt}:
                    self.bad(f"step {key}: attempt {r.attempt} recorded {plain(r.result)}")
            elif isinstance(r, StepFailedRecord):
                if r.error_type != LOST and not (
                    r.error_type == "RuntimeError" and r.attempt <= fail
                ):
                    self.bad(f"step {key}: attempt {r.attempt} failed with {r.error_type}")
                will_retry = r.attempt < maximum
                if (r.next_attempt_at_ms is not None) != will_retry:
                    self.bad(
                        f"step {key}: attempt {r.attempt} of {maximum} failed with "
                        f"next_attempt_at_ms={r.next_attempt_at_ms}"
                    )
                retry_at = r.next_attempt_at_ms
                settled = not will_retry
        successes = [r for r in records if isinstance(r, StepSucceeded)]
        if len(successes) > 1:
            self.bad(f"step {key} succeeded {len(successes)} times")

    def sleeps_and_waits(self) -> None:
        ops = {op["key"]: op for op in self.plan["ops"] if op["op"] in ("sleep", "wait")}
        started: dict[str, HistoryRecord] = {}
        resolved: Counter[str] = Counter()
        # The code reached a sleep or wait after the record before it was written: its
        # deadline is at least that record's time plus the duration. One begun as the
        # start was applied counts from when the start was taken (docs/workflows.md,
        # "Workflow time"): at least from when the client called start.
        calls = [s.at_ms for s in self.sent if s.kind == "start" and s.at_ms]
        called = min(calls) if calls else None
        for previous, r in zip([None, *self.story], self.story, strict=False):
            before = previous.time_ms if previous is not None else 0
            if isinstance(previous, WorkflowStarted) and called is not None:
                before = called
            if isinstance(r, (SleepStarted, WaitStarted)):
                op = ops.get(r.key)
                if op is None or r.key in started:
                    self.bad(f"{r.type} {r.key!r}: not in the plan, or started twice")
                    continue
                started[r.key] = r
                if isinstance(r, SleepStarted):
                    if r.wake_at_ms < before + round(op["seconds"] * 1000):
                        self.bad(f"sleep {r.key}: wakes at {r.wake_at_ms}, too early")
                elif r.event_name != op["event"]:
                    self.bad(f"wait {r.key}: waits for {r.event_name!r}")
                elif (op["timeout"] is None) != (r.timeout_at_ms is None):
                    self.bad(f"wait {r.key}: timeout_at_ms {r.timeout_at_ms}, plan {op}")
                elif r.timeout_at_ms is not None and r.timeout_at_ms < before + round(
                    op["timeout"] * 1000
                ):
                    self.bad(f"wait {r.key}: times out at {r.timeout_at_ms}, too early")
            elif isinstance(r, (SleepElapsed, WaitSatisfied, WaitTimedOut)):
                resolved[r.key] += 1
                begun = started.get(r.key)
                if begun is None:
                    self.bad(f"{r.type} {r.key!r} before it began")
                elif isinstance(r, SleepElapsed):
                    if not isinstance(begun, SleepStarted):
                        self.bad(f"SleepElapsed of {begun.type} {r.key}")
                    elif r.time_ms < begun.wake_at_ms:
                        self.bad(
                            f"sleep {r.key} ended {begun.wake_at_ms - r.time_ms} ms early "
                            f"(wake at {begun.wake_at_ms}, elapsed at {r.time_ms})"
                        )
                elif not isinstance(begun, WaitStarted):
                    self.bad(f"{r.type} of {begun.type} {r.key}")
                elif isinstance(r, WaitTimedOut):
                    if begun.timeout_at_ms is None or r.time_ms < begun.timeout_at_ms:
                        self.bad(f"wait {r.key} timed out early (timeout at {begun.timeout_at_ms})")
                elif r.event_name != begun.event_name:
                    self.bad(f"wait {r.key} for {begun.event_name!r} got {r.event_name!r}")
        for key, n in resolved.items():
            if n > 1:
                self.bad(f"{key!r} resolved {n} times")

    def paused_spans(self) -> None:
        paused = False
        for r in self.story:
            if isinstance(r, WorkflowPaused):
                if paused:
                    self.bad(f"seq {r.seq}: paused while paused")
                paused = True
            elif isinstance(r, WorkflowResumed):
                if not paused:
                    self.bad(f"seq {r.seq}: resumed while not paused")
                paused = False
            elif paused and (r.type in CODE_DRIVEN or isinstance(r, WorkflowCompleted)):
                self.bad(f"seq {r.seq}: {r.type} while paused")

    # ---- the story against the commands -------------------------------------------------

    def applied(self) -> dict[str, tuple[str, list[HistoryRecord]]]:
        """Each client command the story names: its type, and the records that applied
        it (its primary record, or CommandIgnored), which must be exactly one. Read from
        the story itself (CommandIgnored names the type), so it needs no commands log."""
        applied: dict[str, tuple[str, list[HistoryRecord]]] = {}
        for r in self.story:
            if not is_client_command(r.command_id):
                continue
            records = applied.setdefault(r.command_id, ("", []))[1]
            if isinstance(r, WaitSatisfied) and r.event_command_id != r.command_id:
                continue  # a buffered event claimed while this command was applied
            kind = r.command_type if isinstance(r, CommandIgnored) else APPLIES.get(type(r))
            if kind is not None:
                records.append(r)
                applied[r.command_id] = (applied[r.command_id][0] or kind, records)
        return applied

    def _ignored(self, command_ids: list[str]) -> bool:
        """Whether one of ``command_ids`` is in the story as CommandIgnored."""
        return any(
            isinstance(r, CommandIgnored)
            for command_id in command_ids
            for r in self.commands_applied.get(command_id, ("", []))[1]
        )

    def commands_applied_once(self) -> None:
        for command_id, (kind, records) in self.commands_applied.items():
            if len(records) != 1:
                self.bad(
                    f"command {command_id} ({kind or 'of unknown type'}) applied "
                    f"{len(records)} times: {[(r.seq, r.type) for r in records]}"
                )
            types = {APPLIES.get(type(r)) or getattr(r, "command_type", "") for r in records}
            if len(types) > 1:
                self.bad(f"command {command_id} applied as {sorted(types)}")
        if self.commands_log is None:
            return
        for command_id, command in self.commands_log.items():
            kind, records = self.commands_applied.get(command_id, ("", []))
            if not records:
                self.bad(f"{command.type} {command_id} is on the commands log but never applied")
            elif kind != command.type:
                self.bad(f"{command.type} {command_id} on the log was applied as a {kind}")
        for command_id in self.commands_applied:
            if command_id not in self.commands_log:
                self.bad(f"the story names a client command {command_id} not on the log")

    def events_in_order(self) -> None:
        """Per event name, the events claimed by waits are the first ones that arrived, in
        the order they arrived; each is claimed at most once, never before it arrived."""
        arrived: dict[str, list[str]] = defaultdict(list)  # name -> command ids
        arrived_at: dict[str, int] = {}
        claimed: dict[str, list[str]] = defaultdict(list)
        for r in self.story:
            if isinstance(r, EventBuffered) or (
                isinstance(r, WaitSatisfied) and r.event_command_id == r.command_id
            ):
                arrived[r.event_name].append(r.command_id)
                arrived_at[r.command_id] = r.seq
            if isinstance(r, WaitSatisfied):
                claimed[r.event_name].append(r.event_command_id)
                if r.event_command_id not in arrived_at:
                    self.bad(f"seq {r.seq}: wait {r.key} claimed an event that never arrived")
        for name, ids in claimed.items():
            if Counter(ids).most_common(1)[0][1] > 1:
                self.bad(f"an event {name!r} was claimed twice: {ids}")
            if ids != arrived[name][: len(ids)]:
                self.bad(
                    f"events {name!r} claimed out of arrival order: claimed {ids}, "
                    f"arrived {arrived[name]}"
                )

    def acknowledged(self) -> None:
        """Every acknowledged command was applied (and not ignored); no call was applied
        as more than one command."""
        by_eid: dict[str, list[HistoryRecord]] = defaultdict(list)
        for _, records in self.commands_applied.values():
            for r in records:
                if isinstance(r, (EventBuffered, WaitSatisfied)):
                    by_eid[str(_eid(r.payload))].append(r)
        # kafka:// (the commands log is kept) acknowledges a command once the broker has it,
        # and says whether it took effect only when the owner confirms in time: there an
        # acknowledged command may also have been recorded as ignored (it arrived after the
        # instance finished), never lost.
        durable_only = self.commands_log is not None
        on_log: dict[str, list[str]] = defaultdict(list)  # eid or cancel reason -> ids
        if self.commands_log is not None:
            for command in self.commands_log.values():
                if isinstance(command, SendEvent):
                    on_log[str(_eid(command.payload))].append(command.command_id)
                elif isinstance(command, CancelWorkflow):
                    on_log[command.reason].append(command.command_id)
            for eid, ids in on_log.items():
                if len(ids) > 1:
                    self.bad(f"event {eid} is on the commands log as {len(ids)} commands: {ids}")
        for eid, records in by_eid.items():
            if len(records) > 1:
                self.bad(f"event {eid} arrived {len(records)} times: {[r.seq for r in records]}")
        calls = Counter(s.kind for s in self.sent)
        acked = Counter(s.kind for s in self.sent if s.acked)
        for kind, cls in (("pause", PauseWorkflow), ("resume", ResumeWorkflow)):
            named = [rs for k, rs in self.commands_applied.values() if k == cls.__name__]
            took = sum(
                1 for rs in named if rs and (durable_only or not isinstance(rs[0], CommandIgnored))
            )
            if len(named) > calls[kind]:
                self.bad(f"{len(named)} {cls.__name__} commands applied for {calls[kind]} calls")
            if took < acked[kind]:
                self.bad(f"{acked[kind]} acknowledged {kind}s but {took} applied")
        last_seq = 0
        for s in self.sent:
            if not s.acked:
                continue
            if durable_only and self._ignored(on_log.get(s.ident, [])):
                continue
            if s.kind == "event":
                records = by_eid.get(s.ident, [])
                if not records:
                    self.bad(f"acknowledged event {s.ident} ({s.name}) never arrived")
                    continue
                # One caller sent this instance's events one after another: the
                # acknowledged ones arrived in the order they were acknowledged.
                if records[0].seq < last_seq:
                    self.bad(f"acknowledged event {s.ident} arrived before an earlier one")
                last_seq = records[0].seq
            elif s.kind == "cancel":
                if not any(
                    isinstance(r, WorkflowCancelledRecord) and r.reason == s.ident
                    for r in self.story
                ):
                    self.bad(f"acknowledged cancel {s.ident!r} not applied")
            elif s.kind == "start" and not isinstance(self.story[0], WorkflowStarted):
                self.bad("acknowledged start not applied")

    # ---- the step ledger -------------------------------------------------------------------

    def body_runs(self) -> None:
        """Bodies run at least once and within the retry policy: each body run belongs to
        an attempt the log accepted, no attempt's body runs twice, and each recorded
        success came from a body run that ended."""
        accepted = {(r.key, r.attempt) for r in self.story if isinstance(r, StepAttemptStarted)}
        runs = Counter(
            (key, attempt) for key, attempt, _, what, _ in self.ledger if what == "start"
        )
        for (key, attempt), n in runs.items():
            if (key, attempt) not in accepted:
                pids = {p for k, a, p, w, _ in self.ledger if (k, a) == (key, attempt)}
                self.bad(
                    f"step {key}: a body ran as attempt {attempt} (pid {sorted(pids)}), "
                    "which the log does not accept"
                )
            if n > 1:
                self.bad(f"step {key}: the body of attempt {attempt} ran {n} times")
        ended = {(k, a) for k, a, _, what, _ in self.ledger if what == "end"}
        for r in self.story:
            if isinstance(r, StepSucceeded) and (r.key, r.attempt) not in ended:
                self.bad(f"step {r.key}: attempt {r.attempt} succeeded without a body run")

    # ---- where it ended -----------------------------------------------------------------

    def outcome(self) -> None:
        end = next((r for r in self.story if isinstance(r, TERMINAL)), None)
        acked_cancel = any(s.kind == "cancel" and s.acked for s in self.sent)
        if (
            acked_cancel
            and not isinstance(end, WorkflowCancelledRecord)
            and not self._ended_first(end)
        ):
            self.bad(f"a cancel was acknowledged, but it ended with {end and end.type}")
        if isinstance(end, WorkflowCancelledRecord) or acked_cancel:
            return
        forever = bool(self.plan["ops"]) and self.plan["ops"][-1].get("event") == "never"
        if forever:
            waiting = [r for r in self.story if isinstance(r, WaitStarted) and r.key == "forever"]
            if end is not None or not waiting:
                self.bad("should be waiting for 'never' for ever, but is not")
            return
        if not isinstance(end, WorkflowCompleted):
            self.bad(f"should have completed, ended with {end and end.type}")
            return
        self._result(plain(end.result))

    def _ended_first(self, end: HistoryRecord | None) -> bool:
        """kafka:// acknowledges a cancel once the broker has it: one that reached the log
        after the instance finished is recorded as ignored, fairly, if what ended the
        instance came first: a command earlier on the log, or a step outcome (applied as
        it arrives). An end the new owner's recovery decided on its own while the cancel
        waited on the log is not fair: commands on the log apply first."""
        if end is None or self.commands_log is None:
            return False
        order = self.log_order
        cancels = [
            command.command_id
            for command in self.commands_log.values()
            if isinstance(command, CancelWorkflow)
            and any(s.kind == "cancel" and s.acked and s.ident == command.reason for s in self.sent)
        ]
        if not cancels or not self._ignored(cancels):
            return False
        if end.command_id.startswith("step:"):
            return True
        first = min(order[c] for c in cancels)
        return end.command_id in order and order[end.command_id] < first

    def _result(self, result: Any) -> None:
        by_key = defaultdict(list)
        for r in self.story:
            by_key[getattr(r, "key", "")].append(r)
        ops = self.plan["ops"]
        if not isinstance(result, list) or len(result) != len(ops):
            self.bad(f"result {result!r} does not match the plan's {len(ops)} ops")
            return
        for op, got in zip(ops, result, strict=True):
            if op["op"] == "gather":
                expected = [self._step_result(s["key"], by_key[s["key"]]) for s in op["steps"]]
            elif op["op"] == "step":
                expected = self._step_result(op["key"], by_key[op["key"]])
            elif op["op"] == "sleep":
                expected = "slept"
            else:
                ends = [
                    r for r in by_key[op["key"]] if isinstance(r, (WaitSatisfied, WaitTimedOut))
                ]
                expected = (
                    plain(ends[0].payload)
                    if ends and isinstance(ends[0], WaitSatisfied)
                    else "timeout"
                )
            if got != expected:
                self.bad(f"result of {op.get('key', op['op'])}: {got!r}, history says {expected!r}")

    def _step_result(self, key: str, records: list[HistoryRecord]) -> Any:
        for r in records:
            if isinstance(r, StepSucceeded):
                return plain(r.result)
        failed = [r for r in records if isinstance(r, StepFailedRecord)]
        return {"failed": failed[-1].attempt if failed else 0}

    def final_status(self, status: str, waits: list[tuple[str, str]]) -> None:
        end = next((r for r in self.story if isinstance(r, TERMINAL)), None)
        expected = {
            None: "running",
            WorkflowCompleted: "completed",
            WorkflowCancelledRecord: "cancelled",
            WorkflowFailedRecord: "failed",
        }[type(end) if end is not None else None]
        if status != expected:
            self.bad(f"status {status}, its story says {expected}")
        if end is None and waits != [("wait", "forever")]:
            self.bad(f"still running, waiting for {waits} (expected only 'forever')")


def render_instance(run: Run, instance: str, problems: list[str]) -> str:
    lines = [f"instance {instance}: {len(problems)} problems"]
    lines += [f"  ! {p}" for p in problems]
    lines.append(f"  plan: {json.dumps(run.plans.get(instance))}")
    lines.append("  story (as the log folds it):")
    lines += ["    " + render_record(r) for r in run.folded.stories.get(instance, [])]
    skipped = [
        (kind, x)
        for kind, xs in (("stale", run.folded.stale), ("redelivered", run.folded.redelivered))
        for x in xs
        if x.record.instance_id == instance
    ]
    if skipped:
        lines.append("  skipped by the fold:")
        lines += [
            f"    {kind} p{x.partition}@{x.offset} {render_record(x.record)}" for kind, x in skipped
        ]
    if run.commands is not None:
        lines.append("  commands on the log:")
        lines += [
            f"    p{x.partition}@{x.offset} {x.record.type} {x.record.command_id} {attrs(x.record)}"
            for x in run.commands
            if x.record.instance_id == instance
        ]
    lines.append("  client calls:")
    lines += [
        f"    {s.at:.3f} {s.kind} {s.name} {s.ident} "
        + ("acked" if s.acked else f"error: {s.error[:120]}")
        for s in run.sent
        if s.instance == instance
    ]
    lines.append("  step ledger:")
    lines += [f"    {line}" for line in run.ledger.get(instance, [])]
    return "\n".join(lines)
