"""The calls ``Context`` makes into an instance runtime: steps, sleeps, waits, children,
loops, races, messages, patches, recorded values and search attributes, each keyed for
replay."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from stepstream.engine.api.attributes import MAX_ATTRIBUTES, attribute_problem, merged, plain
from stepstream.engine.api.retry import DEFAULT_RETRY, RetryPolicy
from stepstream.engine.api.scopes import current_scope
from stepstream.engine.errors import (
    Evicted,
    InvalidWorkflowCall,
)
from stepstream.engine.replay.core import _child_result_key
from stepstream.engine.replay.driving import DrivingMixin
from stepstream.engine.replay.effects import FORGET_AT_LEAST, PATCH_PREFIX, Phase, StepIntent
from stepstream.engine.replay.ids import RUN_TIMEOUT_KEY, child_event, loop_prefixes, reply_key
from stepstream.engine.replay.loop import ROOT_TASK, WorkflowLoop
from stepstream.engine.replay.state import EntryKind, EntryState
from stepstream.engine.wire.codec import (
    check_size,
    decode_safely,
    encode_safely,
)
from stepstream.engine.wire.names import event_name_problem, name_problem, step_name_problem
from stepstream.engine.wire.records import (
    AttributesSet,
    CallRemoved,
    ChildStarted,
    LoopAdvanced,
    MessageCompleted,
    MessageSent,
    MessageWaitStarted,
    RaceDecided,
    SleepStarted,
    TimerCancelled,
    ValueRecorded,
    WaitStarted,
)


class CallsMixin(DrivingMixin):
    """What ``Context`` calls (``engine.api.runtime.WorkflowRuntime``): each finds its
    replay key in the state and returns the recorded outcome, or records a new entry."""

    @property
    def queue_request(self) -> tuple[int, str | None]:
        """(priority, queue key) the instance was started with."""
        return self.state.queue_request

    @property
    def run(self) -> int:
        """The instance's run: 1, then one more for each restart."""
        return self.state.run

    def key_for(self, name: str) -> str:
        """The replay key of the next use of ``name`` in the current scope: the name
        itself the first time, ``name#n`` the nth time, prefixed with the scope."""
        if self._phase is Phase.CLOSING:
            raise Evicted(
                f"instance {self.state.instance_id} is being evicted: ctx calls in finally "
                "blocks record nothing (do not catch Evicted)"
            )
        problem = step_name_problem(name)
        if problem is not None:
            raise InvalidWorkflowCall(f"instance {self.state.instance_id}: name {problem}")
        # One string per name in its scope: a scope ends with "/" and a name has none.
        slot = current_scope.get() + name
        loop = self._loop
        task = asyncio.current_task() if loop is not None else None
        tick = 0
        if loop is not None:
            tick = loop.ticks
            loop.ticks += 1
        names = self._names
        if slot not in names:
            names[slot] = (task, tick)
            return slot
        last, used = names[slot]
        # Two tasks that were alive together (the other one still runs, or this one
        # already existed when the other used the name) may reach it in another order
        # on replay, where recorded waits are over at once: refused.
        if (
            last is not None
            and task is not None
            and loop is not None
            and task is not last
            and not _within(task, last)
            and (not last.done() or (not _within(last, task) and loop.born(task) < used))
        ):
            raise InvalidWorkflowCall(
                f"instance {self.state.instance_id}: name {slot!r} is used by two "
                "concurrent branches; which use came first could differ on replay. Give "
                "each branch its own scope (ctx.scope, ctx.join) or its own name"
            )
        names[slot] = (task, tick)
        uses = self._repeats.get(slot, 1) + 1
        self._repeats[slot] = uses
        return f"{slot}#{uses}"

    def step_future(
        self,
        key: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retry: RetryPolicy | None,
        timeout: float | None,
        ephemeral: bool = False,
    ) -> asyncio.Future[Any]:
        if not callable(fn):
            raise TypeError(f"ctx.step({key!r}, ...): {fn!r} is not callable")
        entry = self._visit(key, EntryKind.STEP)
        if entry is None or not entry.state.final:  # a replayed outcome starts nothing
            self._intents[key] = StepIntent(
                fn, args, kwargs, retry or DEFAULT_RETRY, timeout, ephemeral
            )
        fut = self._future(entry, key)
        if (entry is None and key not in self._ephemeral) or (
            entry is not None
            and entry.state in (EntryState.RUNNING, EntryState.BACKOFF)
            and (key, entry.attempt) not in self.inflight
            and (
                entry.state is EntryState.RUNNING
                or (self._phase is Phase.RETRIES_DUE and self._overdue(entry))
            )
        ):
            self._deferred.append(("step", key))
        return fut

    def sleep_future(
        self, key: str, *, delay_ms: int | None = None, wake_at_ms: int | None = None
    ) -> asyncio.Future[Any]:
        entry = self._visit(key, EntryKind.SLEEP)
        if entry is None:
            wake = wake_at_ms if wake_at_ms is not None else self.now_ms() + (delay_ms or 0)
            self._emit(SleepStarted, key=key, wake_at_ms=wake)
            self._deferred.append(("sleep", key))
        # An overdue sleep found on replay is left to its timer, whose fire comes through
        # the command log: commands already there (a cancel) apply first.
        return self._future(entry, key)

    def wait_future(self, key: str, event_name: str, timeout_ms: int | None) -> asyncio.Future[Any]:
        entry = self._visit(key, EntryKind.WAIT)
        if entry is None:
            timeout_at = None if timeout_ms is None else self.now_ms() + timeout_ms
            self._emit(WaitStarted, key=key, event_name=event_name, timeout_at_ms=timeout_at)
            self._deferred.append(("wait", key))
        elif entry.state is EntryState.WAITING:  # an overdue timeout is left to its timer
            if any(b.name == event_name for b in self.state.buffered):
                self._deferred.append(("wait", key))
        return self._future(self.state.entries.get(key), key)

    def start_child(self, key: str, workflow: str, input: Any, instance_id: str | None) -> str:
        """Record and publish the start of a child (once: replay returns its id)."""
        entry = self._visit(key, EntryKind.CHILD)
        if entry is not None:
            assert entry.child_id is not None
            return entry.child_id
        # A restarted run's children are new instances: the first run's keep their ids.
        run = "" if self.state.run == 1 else f"run{self.state.run}/"
        child_id = instance_id or f"{self.state.instance_id}/{run}{key}"
        problem = name_problem(child_id) or name_problem(workflow)
        if problem is not None:
            raise InvalidWorkflowCall(f"child {key!r} of {self.state.instance_id}: {problem}")
        payload = check_size(
            encode_safely(self.codec, input),
            self.max_payload_bytes,
            what=f"the input of child {key!r} of instance {self.state.instance_id}",
        )
        self._emit(ChildStarted, key=key, workflow=workflow, child_id=child_id, input=payload)
        self._out.commands.append(
            (self.state.instance_id, self._child_start(self.state.entries[key]))
        )
        return child_id

    def child_result(self, key: str) -> asyncio.Future[Any]:
        """The child's outcome (a dict with its status, result or error), delivered as
        the event it sends when it finishes."""
        return self.wait_future(_child_result_key(key), child_event(key), None)

    def loop_resume(self, key: str, initial: Any) -> tuple[int, Any]:
        """Where the loop ``key`` starts: its last recorded iteration and state, or 0 and
        ``initial`` the first time."""
        entry = self._visit(key, EntryKind.LOOP)
        if entry is None:
            return 0, initial
        assert entry.result is not None
        return entry.attempt, self.decode_recorded(entry.result, f"the state of loop {key!r}")

    def loop_advanced(self, key: str, iteration: int, state: Any, keep: int) -> Any:
        """Record that the loop goes on with ``iteration`` and ``state``; returns the
        state as replay will see it (decoded from what was recorded)."""
        payload = check_size(
            encode_safely(self.codec, state),
            self.max_payload_bytes,
            what=f"the state of loop {key!r} of instance {self.state.instance_id}",
        )
        self._emit(LoopAdvanced, key=key, iteration=iteration, state=payload, keep=keep)
        self._forget_scope(loop_prefixes(key, iteration - 1))
        return decode_safely(self.codec, payload)

    def _forget_scope(self, prefixes: tuple[str, ...]) -> None:
        """Drop what the live coroutine kept about a finished loop iteration (its keys
        are never used again), so an endless loop runs in bounded memory.

        In batches: once what it keeps has doubled since the last batch, one walk drops
        every finished iteration's keys. A walk per iteration would cost each iteration
        as much as every key the instance holds (its steps before the loop included)."""
        for prefix in prefixes:
            assert prefix[-1:] in ("/", "."), prefix  # a scope's, or its tasks'
            self._forget_roots.add(prefix[:-1])
        if self._kept() < self._forget_at:
            return
        roots, self._forget_roots = self._forget_roots, set()

        def gone(key: str) -> bool:
            return _under(key, roots)

        for key in [k for k in self._futures if gone(k)]:
            del self._futures[key]
        for key in [k for k in self._intents if gone(k)]:
            if not any(k == key for k, _ in self.inflight):
                del self._intents[key]
        self._visited.difference_update([k for k in self._visited if gone(k)])
        for slot in [s for s in self._names if gone(s[: s.rfind("/") + 1])]:
            del self._names[slot]
            self._repeats.pop(slot, None)
        for counter in [c for c in self._counters if gone(c)]:
            del self._counters[counter]
        if self._loop is not None:
            self._loop.forget_tasks(gone)
        self._forget_at = max(FORGET_AT_LEAST, 2 * self._kept())

    def _kept(self) -> int:
        """How much the coroutine keeps about the keys it used."""
        return (
            len(self._futures)
            + len(self._intents)
            + len(self._visited)
            + len(self._names)
            + len(self._counters)
        )

    def race_decided(self, key: str) -> tuple[str, list[str]] | None:
        """The recorded winner and losers of the race ``key``, or None if it is open."""
        entry = self._visit(key, EntryKind.RACE)
        if entry is None:
            return None
        assert entry.winner is not None
        return entry.winner, list(entry.losers or ())

    def recorded_at(self, key: str) -> int:
        """The seq at which the history first recorded ``key`` (0: not recorded)."""
        entry = self.state.entries.get(key)
        return entry.seq if entry is not None else 0

    def race_lost(self, task_path: str) -> None:
        """A race branch's task that lost on replay (started, then cancelled): what it
        recorded under its task path is not reached again."""
        self._lost_tasks.append(task_path)

    def decide_race(self, key: str, winner: str, losers: list[str]) -> None:
        """Record the winner; abandon what the losing branches (scope prefixes) were
        doing: their timers are cancelled and their running attempts given up."""
        prefixes = tuple(losers)
        abandoned = [e for e in self.state.under(prefixes) if not e.state.final]
        for entry in abandoned:
            if entry.timer_id is not None:
                self._timer(TimerCancelled, timer_id=entry.timer_id)
        self._give_up_attempts(abandoned, prefixes)
        # Taken before the record, which withdraws the losers' waits (their children's too).
        children = [e for e in self._waited_children() if e.key.startswith(prefixes)]
        self._emit(RaceDecided, key=key, winner=winner, losers=losers)
        self._cancel_children(children, self._race_lost_reason(key))

    def message_future(
        self, key: str, names: list[str], max_messages: int, timeout_ms: int | None
    ) -> asyncio.Future[Any]:
        """Up to ``max_messages`` messages of any of ``names`` (at least one), as raw
        (id, name, payload, arrived at ms) tuples; ``EventTimeout`` after the timeout."""
        entry = self._visit(key, EntryKind.WAIT)
        if entry is None:
            timeout_at = None if timeout_ms is None else self.now_ms() + timeout_ms
            self._emit(
                MessageWaitStarted,
                key=key,
                names=names,
                max=max_messages,
                timeout_at_ms=timeout_at,
            )
            self._deferred.append(("messages", key))
        elif entry.state is EntryState.WAITING:  # an overdue timeout is left to its timer
            if any(b.name in names for b in self.state.buffered):
                self._deferred.append(("messages", key))
        return self._future(self.state.entries.get(key), key)

    def send_message(self, key: str, target: str, name: str, payload: Any) -> None:
        """Record a message for another instance and publish it (once: replay sends
        nothing, and the receiver applies a repeat of its command id once)."""
        if self._visit(key, EntryKind.SENT) is not None:
            return
        problem = name_problem(target)
        if problem is not None:
            problem = f"the instance id it goes to, {target!r}, {problem}"
        elif (problem := event_name_problem(name)) is not None:
            problem = f"its name {name!r} {problem}"
        if problem is not None:
            raise InvalidWorkflowCall(f"message {key!r} of {self.state.instance_id}: {problem}")
        encoded = check_size(
            encode_safely(self.codec, payload),
            self.max_payload_bytes,
            what=f"message {name!r} from instance {self.state.instance_id}",
        )
        self._emit(MessageSent, key=key, target=target, name=name, payload=encoded)
        entry = self.state.entries[key]
        self._publish_message(entry, self._message(entry))

    def given_back(self, slot_key: str) -> int:
        """How many asks for the queue slot ``slot_key`` a reset or fork gave back."""
        return self.state.requeued.get(slot_key, 0)

    def complete_message(self, message_id: str, value: Any) -> None:
        """Answer a message (a client's request() gets ``value``); once per message:
        answering it again in the same run changes nothing."""
        key = reply_key(message_id)
        if key in self._visited or self._visit(key, EntryKind.VALUE) is not None:
            return
        result = check_size(
            encode_safely(self.codec, value),
            self.max_payload_bytes,
            what=f"the answer to message {message_id} of instance {self.state.instance_id}",
        )
        self._emit(MessageCompleted, message_id=message_id, result=result)

    def patched(self, patch_id: str) -> bool:
        """True where code with the patch first reaches this point (recorded, so replay
        says True again); False while replaying a history recorded before the patch (it
        goes on past this point without a record of it). One answer per id and run."""
        problem = step_name_problem(patch_id)
        if problem is not None:
            raise InvalidWorkflowCall(f"instance {self.state.instance_id}: patch id {problem}")
        key = f"{PATCH_PREFIX}{patch_id}"
        known = self._patches.get(key)
        if known is not None:
            return known
        if key in self.state.entries:
            self._visited.add(key)
            answer = True
        elif self._replaying and self._history_goes_on():
            answer = False  # this history was made by code without the patch
        else:
            marker = encode_safely(self.codec, True)
            self._emit(ValueRecorded, key=key, kind="patch", value=marker)
            self._visited.add(key)
            answer = True
        self._patches[key] = answer
        return answer

    def removed(self, key: str) -> None:
        """Code no longer has the step, sleep or wait ``key``: an older history's entry
        for it counts as reached (its attempt, if one still runs, is given up)."""
        entry = self.state.entries.get(key)
        if entry is None or key in self._visited:
            return
        self._visited.add(key)
        if entry.state.final:
            return
        if entry.timer_id is not None:
            self._timer(TimerCancelled, timer_id=entry.timer_id)
        self._give_up_attempts([entry])
        self._emit(CallRemoved, key=key)  # abandoned: no status or wait shows it open

    def _history_goes_on(self) -> bool:
        """Whether recorded entries remain that replay has not reached yet."""
        return any(
            key not in self._visited and not key.startswith(PATCH_PREFIX) and key != RUN_TIMEOUT_KEY
            for key in self.state.entries
        )

    def _value_key(self, kind: str) -> str:
        if self._phase is Phase.CLOSING:
            raise Evicted(f"instance {self.state.instance_id} is being evicted")
        # Values have no name, so their key is the task that read them plus a count;
        # parallel branches may run in another order on replay but keep their paths.
        path = WorkflowLoop.task_path()
        scope = f"{kind}#" if path == ROOT_TASK else f"{path}/{kind}#"
        n = self._counters.get(scope, 0) + 1
        self._counters[scope] = n
        return f"{scope}{n}"

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        """Record search attributes (None removes a key); replay finds the record and
        records nothing (the state already holds what it set)."""
        key = self._value_key("attributes")
        if self._visit(key, EntryKind.VALUE) is not None:
            return
        where = f"instance {self.state.instance_id}: ctx.set_attributes"
        for name, value in attributes.items():
            problem = attribute_problem(name, value)
            if problem is not None:
                raise InvalidWorkflowCall(f"{where}: {problem}")
        attributes = {name: plain(value) for name, value in attributes.items()}
        total = len(merged(self.state.attributes, attributes))
        if total > MAX_ATTRIBUTES:
            raise InvalidWorkflowCall(
                f"{where} would give the instance {total} attributes; the limit is "
                f"{MAX_ATTRIBUTES} (remove some with None, or keep the data in a step result)"
            )
        self._emit(AttributesSet, key=key, attributes=attributes)

    def record_value(self, kind: str, produce: Callable[[], Any]) -> Any:
        key = self._value_key(kind)
        entry = self._visit(key, EntryKind.VALUE)
        if entry is not None:
            assert entry.result is not None
            return self.decode_recorded(entry.result, f"the recorded value {key!r}")
        value = produce()
        self._emit(ValueRecorded, key=key, kind=kind, value=encode_safely(self.codec, value))
        return value


def _within(task: asyncio.Task[Any] | None, ancestor: asyncio.Task[Any]) -> bool:
    """Whether ``task`` was created (directly or not) by ``ancestor``: the workflow loop
    names tasks by their path from the root task."""
    if task is None:
        return False
    root = ancestor.get_name()
    return task.get_name().startswith(root + ".") or root == ROOT_TASK


def _under(key: str, roots: set[str]) -> bool:
    """Whether ``key`` starts with one of ``roots`` followed by "/" or "." (it is a key
    of that scope, or of a task it ran)."""
    for index, char in enumerate(key):
        if (char == "/" or char == ".") and key[:index] in roots:
            return True
    return False
