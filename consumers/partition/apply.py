"""Turning inputs into a batch: each command, timer fire and step outcome applied to its
instance's runtime, with what did not take effect settled (dead-lettered, scheduled
again, or sent round again) so that nothing is lost and nothing applies twice.

The processor commits what this builds; nothing here waits or writes.
"""

from __future__ import annotations

import logging

from stepstream.consumers import log_context
from stepstream.consumers import state_keys as keys
from stepstream.consumers.dead_letters import dead_letter
from stepstream.consumers.index_marks import make_whole
from stepstream.consumers.instance_store import InstanceReads, StoredHistory
from stepstream.consumers.log_context import instance_fields
from stepstream.consumers.partition.batch import Batch
from stepstream.consumers.partition.containment import Containment
from stepstream.consumers.partition.intake import CommandIntake, Rejected
from stepstream.consumers.partition.settings import REFIRE_AFTER_INTERNAL_ERROR_S
from stepstream.consumers.runtime_cache import RuntimeCache
from stepstream.consumers.telemetry import Telemetry
from stepstream.consumers.timers import OwnFires, unindex
from stepstream.engine.api.workflow import Registry
from stepstream.engine.errors import HistoryDiverged, UnknownWorkflow
from stepstream.engine.replay.effects import Output, StepOutcome
from stepstream.engine.replay.ids import is_client_command
from stepstream.engine.replay.reset import fork_records
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.seams import Append, Clock, LogEntry, PartitionBackend
from stepstream.engine.wire.records import (
    Command,
    ForkWorkflow,
    PartitionFenced,
    ResetWorkflow,
    RetryWorkflow,
    StartFork,
    StartWorkflow,
    TimerFired,
    TimerScheduled,
    WorkflowStarted,
)
from stepstream.engine.wire.serde import RecordSerde
from stepstream.engine.wire.settle import UNKNOWN_INSTANCE, ignored_reason, recorded_reason
from stepstream.engine.wire.topics import COMMANDS, HISTORY, TIMERS

# What applying one command came to: its id, why it did not take effect (None if it did)
# and whether it is rejected (dead-lettered) rather than recorded as ignored.
Applied = tuple[str, str | None, bool]

log = logging.getLogger("stepstream.partition")

# Commands an instance refuses with a reason of their own (recorded as ignored).
REFUSABLE = (ResetWorkflow, RetryWorkflow, ForkWorkflow)

# Unfinished instances read together when an owner resumes them.
_RESUME_READ_AHEAD = 1000

NOT_APPLIED_AFTER_ERROR = (
    "not applied: a later input of its instance in the same batch hit an internal error "
    "(see the worker's log); send the command again"
)


class Applier:
    def __init__(
        self,
        backend: PartitionBackend,
        registry: Registry,
        cache: RuntimeCache,
        *,
        serde: RecordSerde,
        clock: Clock,
        intake: CommandIntake,
        telemetry: Telemetry,
    ) -> None:
        self._backend = backend
        self._partition = backend.partition
        self._registry = registry
        self._cache = cache
        self._serde = serde
        self._clock = clock
        self._intake = intake
        self._telemetry = telemetry
        self._containment = Containment(cache, backend.partition)
        self.reads = InstanceReads(backend.store, serde)
        cache.history = StoredHistory(backend.store, serde)
        # Fires this partition's timer service appended: read back without decoding.
        self.own_fires = OwnFires()
        # Instances whose decisions could not be stored (``quarantine``): their inputs
        # are refused, so the rest of the partition goes on.
        self._quarantined: dict[str, str] = {}

    def quarantine(self, instance_id: str, reason: str) -> None:
        """Set ``instance_id`` apart until this process ends: a batch that applied its
        input could not be stored (``Unstorable``), and would fail again each time.
        Its commands are dead-lettered with ``reason`` (a client is told), its timer
        fires and step outcomes dropped; it stays as it was last committed."""
        self._quarantined[instance_id] = (
            f"instance {instance_id} is set apart: what it decided cannot be stored "
            f"({reason}); fix the workflow, then reset, cancel or terminate it (the "
            "worker takes its commands again after a restart)"
        )

    def resumption(self) -> Batch:
        """The first batch of an owner: its fence, and every unfinished instance driven
        from its committed state."""
        batch = Batch(self._clock.now_ms())
        fence = PartitionFenced(
            instance_id="",
            time_ms=self._clock.now_ms(),
            command_id=f"fence:{self._backend.epoch}",
            epoch=self._backend.epoch,
            partition=self._partition,
        )
        batch.commit.appends.append(
            Append(HISTORY, b"", self._serde.encode(fence), self._partition)
        )
        active = [keys.split_active(key) for key, _ in self._backend.store.scan(keys.ACTIVE)]
        for at in range(0, len(active), _RESUME_READ_AHEAD):
            chunk = active[at : at + _RESUME_READ_AHEAD]
            self._cache.preload(chunk)
            try:
                for instance_id in chunk:
                    self._resume_one(instance_id, batch)
            finally:
                self._cache.forget_preloaded()
        for key, _ in list(self._backend.store.scan(keys.WITHDRAW)):
            batch.commit.delete(key)  # with the withdrawals it publishes
            runtime = self._cache.load(keys.split_withdraw(key))
            if runtime is not None:
                runtime.withdraw_again(batch.out)
        # Lists and retention read indexes an older version did not keep: whole again.
        make_whole(self._backend, batch.commit)
        return batch

    def _resume_one(self, instance_id: str, batch: Batch) -> None:
        runtime = self._cache.load(instance_id)
        if runtime is None:
            return
        try:
            runtime.recover(batch.out)
        except HistoryDiverged as exc:
            self._containment.park(runtime, exc, batch, None)
            return
        batch.touched[instance_id] = runtime

    def batch(
        self, entries: list[LogEntry], outcomes: list[StepOutcome], fires: list[TimerFired]
    ) -> Batch:
        """Apply commands fetched from the log, then timer fires handed over directly,
        then step outcomes, into one batch. Lines logged meanwhile (the workflow code's
        too) are about the instance an input is applied to (``Containment.handle``)."""
        token = log_context.current.set(self._containment.subject)
        try:
            # The instances the commands and fires are for, read together (evicted
            # sleepers woken by a run of due timers): each load takes its state from there.
            self._cache.preload(_instance_ids(entries, fires))
            return self._batch(entries, outcomes, fires)
        finally:
            self._cache.forget_preloaded()
            log_context.current.reset(token)

    def _batch(
        self, entries: list[LogEntry], outcomes: list[StepOutcome], fires: list[TimerFired]
    ) -> Batch:
        batch = Batch(self._clock.now_ms())
        for entry in entries:
            instance_id, (command_id, reason, rejected) = self._apply_command(entry, batch)
            if batch.poisoned:
                self._undo_poisoned(batch)
            if rejected:
                assert reason is not None
                batch.commit.appends.append(self.dead_letter(entry, reason, command_id))
            elif command_id:
                batch.record_applied(entry, command_id)
            if command_id:
                batch.settle(instance_id, command_id, reason)
        for fire in fires:  # after the commands: none of them was acknowledged later
            self._apply(fire, batch, direct=True)
            if batch.poisoned:
                self._undo_poisoned(batch)
            batch.record_applied(fire, fire.command_id)
        for outcome in outcomes:
            if self._quarantined and outcome.instance_id in self._quarantined:
                continue
            runtime = self._cache.get(outcome.instance_id)
            if runtime is None and (
                outcome.instance_id in batch.poisoned_seen
                or outcome.instance_id in self._cache.orphaned
            ):
                # Dropped after an internal error: reloaded, it keeps its running attempts.
                runtime = self._cache.load(outcome.instance_id)
            if runtime is None:
                continue  # the instance finished or was dropped; a late outcome changes nothing
            if self._containment.handle(runtime, outcome, batch) is None:
                batch.applied_outcomes.setdefault(outcome.instance_id, []).append(outcome)
            if batch.poisoned:
                self._undo_poisoned(batch)
        self._settle_undone(batch)
        appends = batch.commit.appends
        encode = self._serde.encode
        for notice in batch.notices:
            appends.append(Append(COMMANDS, notice.instance_id.encode(), encode(notice)))
        for refire in batch.refires:
            value = encode(refire)
            appends.append(Append(TIMERS, refire.instance_id.encode(), value, self._partition))
        for fire in fires:
            if fire not in batch.fires_again:  # fired: out of the timer index with what it did
                unindex(batch.commit, fire.fire_at_ms, fire.instance_id, fire.timer_id)
        if entries:
            batch.commit.offsets[COMMANDS] = entries[-1].offset + 1
        return batch

    def recovery(self, instance_ids: list[str]) -> Batch:
        """Instances that hit an internal error (or whose batch was undone), reloaded and
        driven from their committed state (attempts whose outcomes were undone or hit the
        error are recovered as lost), so they do not wait for an input that may never
        come."""
        batch = Batch(self._clock.now_ms())
        out = batch.out
        for instance_id in instance_ids:
            if instance_id in self._quarantined:
                continue
            runtime = self._cache.get_or_load(instance_id)
            if runtime is None:
                continue
            own = Output()  # merged only if the whole recovery succeeds
            try:
                runtime.recover(own)
            except HistoryDiverged as exc:
                self._containment.park(runtime, exc, batch, None)
                continue
            except Exception:
                log.exception(
                    "recovery failed", extra=instance_fields(runtime.state, self._partition)
                )
                self._cache.drop(instance_id)
                continue
            out.history.extend(own.history)
            out.timers.extend(own.timers)
            out.launches.extend(own.launches)
            out.cancels.extend(own.cancels)
            out.commands.extend(own.commands)
            batch.touched[instance_id] = runtime
        return batch

    def _undo_poisoned(self, batch: Batch) -> None:
        # Step outcomes of an undone instance go round again, their attempts still
        # counted as running.
        for instance_id, outcome in batch.undo_poisoned():
            self._cache.orphaned.setdefault(instance_id, set()).add((outcome.key, outcome.attempt))
            batch.outcomes_again.append(outcome)

    def _settle_undone(self, batch: Batch) -> None:
        """Inputs undone after an internal error: client commands are dead-lettered (the
        client sends them again); timer fires go round again (nobody else would)."""
        for instance_id, item, command_id in batch.undone:
            if isinstance(item, TimerFired):
                batch.fires_again.append(item)  # applied again, in the next batch
            elif is_client_command(command_id):
                commit = batch.commit
                commit.appends.append(self.dead_letter(item, NOT_APPLIED_AFTER_ERROR, command_id))
                batch.settle(instance_id, command_id, NOT_APPLIED_AFTER_ERROR)
            else:  # a timer fire read from the log
                appends = batch.commit.appends
                appends.append(Append(COMMANDS, item.key, item.value, self._partition))

    def _apply_command(self, entry: LogEntry, batch: Batch) -> tuple[str, Applied]:
        """The instance the command is for, and what became of it."""
        batch.last_instance = ""
        record: Command | Rejected | None = self.own_fires.take(entry.value)
        if record is None:
            record = self._intake.read(entry)
        if isinstance(record, Rejected):
            return record.instance_id, (record.command_id, record.reason, True)
        applied = self._apply(record, batch, offset=entry.offset, accepted_ms=entry.accepted_ms)
        return record.instance_id, applied

    def _apply(
        self,
        record: Command,
        batch: Batch,
        *,
        direct: bool = False,
        offset: int = -1,
        accepted_ms: int = 0,
    ) -> Applied:
        """Apply one command read from the log (at ``offset``, taken by the log at
        ``accepted_ms``, 0 if it does not say), or a timer fire handed over directly."""
        batch.last_instance = ""
        instance_id = record.instance_id
        if self._quarantined and instance_id in self._quarantined:
            if isinstance(record, TimerFired):
                return record.command_id, None, False  # dropped: it would fail again
            return record.command_id, self._quarantined[instance_id], True
        runtime = batch.touched.get(instance_id) or self._cache.get_or_load(instance_id)
        started_ms = 0  # set for a start that makes a new instance
        if runtime is None:
            if isinstance(record, TimerFired):
                # The timer of an instance that is gone: harmless.
                return record.command_id, None, False
            if isinstance(record, StartFork):
                return self._new_fork(record, batch)
            if not isinstance(record, StartWorkflow):
                return (
                    record.command_id,
                    f"{UNKNOWN_INSTANCE} {instance_id!r}: {record.type} needs an "
                    "instance started with this id",
                    True,
                )
            try:
                definition = self._registry.resolve(record.workflow, record.version)
            except UnknownWorkflow as exc:
                notice = self._intake.child_failed(record, exc)
                if notice is not None:
                    batch.notices.append(notice)
                return record.command_id, str(exc), True
            runtime = self._cache.new(InstanceState(instance_id), definition)
            started_ms = record.time_ms
            # The new instance's clock starts when the log took its start, not when this
            # batch got to it: a sleep or timeout begun before anything else counts from
            # there, so a burst of starts does not delay each by the wait to be applied
            # (docs/workflows.md, "Workflow time"). Never ahead of this engine's clock.
            now = self._clock.now_ms()
            runtime.clock_from_ms = min(accepted_ms or record.time_ms or now, now)
        elif self.reads.applied(runtime.state, record.command_id):
            return record.command_id, None, False  # re-delivered: it changes nothing
        elif (
            isinstance(record, StartWorkflow)
            and record.if_exists == "restart_if_failed"
            and runtime.state.status.restartable
        ):
            # A new run: of the workflow (and version) this start names.
            try:
                runtime.definition = self._registry.resolve(record.workflow, record.version)
            except UnknownWorkflow as exc:
                return record.command_id, str(exc), True
        try:
            error = self._containment.handle(runtime, record, batch)
        finally:
            runtime.clock_from_ms = None
        if error is not None and isinstance(record, TimerFired):
            # Dead-lettered, the fire would be lost (the index let the timer go when it
            # fired): it is scheduled again instead, and accepted as the timer's fire.
            now = self._clock.now_ms()
            batch.refires.append(
                TimerScheduled(
                    instance_id=instance_id,
                    time_ms=now,
                    command_id=record.command_id,
                    epoch=self._backend.epoch,
                    timer_id=record.timer_id,
                    fire_at_ms=now + int(REFIRE_AFTER_INTERNAL_ERROR_S * 1000),
                    purpose="refire",
                )
            )
            return record.command_id, None, False
        if error is not None:
            return record.command_id, error, True
        batch.last_instance = instance_id
        self._telemetry.command_applied(record.type)
        if self._telemetry.traced:
            self._telemetry.activations.input_applied(
                self._partition, record, offset, runtime.state.traceparent
            )
        if started_ms:
            self._telemetry.instance_started(
                runtime.state.workflow, started_ms, self._clock.now_ms()
            )
        if isinstance(record, TimerFired):
            self._telemetry.timer_fired(
                max(0, self._clock.now_ms() - record.fire_at_ms) / 1000, direct=direct
            )
        if runtime.ignored and isinstance(record, REFUSABLE):
            # A reset or fork to a key it lacks, a retry of one that did not fail.
            return record.command_id, recorded_reason(record.type, runtime.ignored_because), False
        if runtime.ignored and not isinstance(record, StartFork):
            # Recorded as ignored (CommandIgnored); the publisher learns why (a start:
            # only when its if_exists refuses an existing id).
            return record.command_id, ignored_reason(record, runtime.state.status.value), False
        return record.command_id, None, False

    def _new_fork(self, record: StartFork, batch: Batch) -> Applied:
        """A fork's new instance, running the workflow version its source ran."""
        assert self._cache.history is not None
        copies = fork_records(record, self._cache.history, self._backend.epoch)
        started = copies[0] if copies else None
        if not isinstance(started, WorkflowStarted):
            return (
                record.command_id,
                "InvalidPayload: a fork's records must begin with its start",
                True,
            )
        try:
            definition = self._registry.resolve(started.workflow, started.version)
        except UnknownWorkflow as exc:
            return record.command_id, str(exc), True
        runtime = self._cache.new(InstanceState(record.instance_id), definition)
        error = self._containment.handle(runtime, record, batch)
        if error is not None:
            return record.command_id, error, True
        batch.last_instance = record.instance_id
        self._telemetry.command_applied(record.type)
        return record.command_id, None, False

    def dead_letter(self, entry: LogEntry, reason: str, command_id: str = "") -> Append:
        self._telemetry.dead_lettered(reason)
        return dead_letter(
            entry,
            reason,
            serde=self._serde,
            backend=self._backend,
            clock=self._clock,
            command_id=command_id,
        )


def _instance_ids(entries: list[LogEntry], fires: list[TimerFired]) -> list[str]:
    """The instances a batch's commands (keyed by instance id) and fires are for."""
    ids = [fire.instance_id for fire in fires]
    for entry in entries:
        try:
            ids.append(entry.key.decode())
        except UnicodeDecodeError:
            continue  # not a command of ours: intake dead-letters it
    return ids
