"""One batch of inputs on its way to a commit: everything the inputs decided, and the
bookkeeping that lets an internal error undo one instance's part of it.

A batch is made for each round of the processing loop (commands fetched, step outcomes
delivered, timer fires handed over), and for the partition's resume and the recovery
of instances after an internal error. It lives until its commit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from stepstream.engine.replay.effects import Output, StepOutcome
from stepstream.engine.replay.runtime import InstanceRuntime
from stepstream.engine.seams import CommitBatch, LogEntry
from stepstream.engine.wire.records import Command, TimerFired, TimerScheduled
from stepstream.engine.wire.settle import settled_key

# A command's log entry, or a timer fire handed over directly, with its command id.
Input = tuple[LogEntry | TimerFired, str]
# An input undone after an internal error, with the instance it had been applied to.
Undone = tuple[str, LogEntry | TimerFired, str]


@dataclass(slots=True, eq=False)
class Batch:
    # When the batch was begun (ms): when a first step attempt it launches became due.
    began_ms: int
    # The same on the system clock (ns), where its activation spans begin.
    began_ns: int = field(default_factory=time.time_ns)
    out: Output = field(default_factory=Output)
    commit: CommitBatch = field(default_factory=CommitBatch)
    # Instances the batch changed: their state is written with the commit.
    touched: dict[str, InstanceRuntime] = field(default_factory=dict)
    # ``settled_key`` -> None when the command took effect, or why not (the publisher
    # learns it).
    settled: dict[str, str | None] = field(default_factory=dict)
    # The inputs applied to each instance (commands, direct fires, step outcomes), so an
    # internal error can undo all of that instance's part of the batch.
    applied: dict[str, list[Input]] = field(default_factory=dict)
    applied_outcomes: dict[str, list[StepOutcome]] = field(default_factory=dict)
    # Inputs undone after an internal error: dead-lettered, or applied again.
    undone: list[Undone] = field(default_factory=list)
    # Instances whose earlier decisions in the batch were just undone (pending the undo
    # of their inputs), and every instance that was.
    poisoned: set[str] = field(default_factory=set)
    poisoned_seen: set[str] = field(default_factory=set)
    # Instances that hit an internal error: reloaded and driven after the commit.
    redrive: set[str] = field(default_factory=set)
    # Timer fires that hit an internal error: scheduled again, a little later.
    refires: list[TimerScheduled] = field(default_factory=list)
    # Commands for other instances decided here, not by a runtime (a child that could
    # not start tells its parent).
    notices: list[Command] = field(default_factory=list)
    # What goes round again into the next batch: step outcomes of an undone instance
    # (their attempts still count as running), and undone direct timer fires.
    outcomes_again: list[StepOutcome] = field(default_factory=list)
    fires_again: list[TimerFired] = field(default_factory=list)
    # The instance the last input applied to ("" when it took no effect).
    last_instance: str = ""

    def settle(self, instance_id: str, command_id: str, reason: str | None) -> None:
        """The command took effect (``reason`` None) or did not, and why."""
        self.settled[settled_key(instance_id, command_id)] = reason

    def record_applied(self, item: LogEntry | TimerFired, command_id: str) -> None:
        if self.last_instance:
            self.applied.setdefault(self.last_instance, []).append((item, command_id))

    def undo_poisoned(self) -> list[tuple[str, StepOutcome]]:
        """An instance whose decisions in this batch were all undone (so far): so are the
        inputs before the failure that led to them (later ones apply anew). Returns the
        step outcomes undone, to go round again (their attempts still count as running)."""
        again: list[tuple[str, StepOutcome]] = []
        for instance_id in self.poisoned:
            self.undone.extend(
                (instance_id, item, command_id)
                for item, command_id in self.applied.pop(instance_id, ())
            )
            again.extend((instance_id, o) for o in self.applied_outcomes.pop(instance_id, ()))
            self.poisoned_seen.add(instance_id)
        self.poisoned.clear()
        return again

    def strip(self, instance_id: str) -> None:
        """Take every decision of one instance out of the batch's output."""
        strip(self.out, instance_id)


def strip(out: Output, instance_id: str) -> None:
    """Take every decision of one instance out of an output."""
    out.history[:] = [r for r in out.history if r.instance_id != instance_id]
    out.timers[:] = [t for t in out.timers if t.instance_id != instance_id]
    out.launches[:] = [x for x in out.launches if x.instance_id != instance_id]
    out.cancels[:] = [c for c in out.cancels if c[0] != instance_id]
    out.commands[:] = [c for c in out.commands if c[0] != instance_id]
