"""The engine's side of queues (``engine.api.queues``) in an instance's runtime: a
request for a slot is published with the start of the queue's instance, the attempts of
a queued step start only once the code holds a slot for each, and an instance that
finishes gives back every slot it still holds or waits for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from stepstream.engine.api.queues import (
    QUEUE_ACQUIRE,
    QUEUE_INSTANCE_PREFIX,
    QUEUE_RELEASE,
    QUEUE_WORKFLOW,
    AttemptBackoff,
    ask_key,
    slot_token,
    step_backoff_key,
)
from stepstream.engine.api.retry import DEFAULT_RETRY, RetryPolicy
from stepstream.engine.errors import StepstreamError
from stepstream.engine.replay.core import RuntimeCore
from stepstream.engine.replay.effects import Output, Phase, StepIntent
from stepstream.engine.replay.ids import message_command
from stepstream.engine.replay.slots import unreleased
from stepstream.engine.replay.state import Entry, EntryKind, EntryState
from stepstream.engine.wire.codec import decode_safely, encode_safely
from stepstream.engine.wire.records import Command, SendEvent, StartWorkflow


class AdmissionMixin(RuntimeCore):
    def queued_attempt_future(
        self,
        key: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        retry: RetryPolicy | None,
        timeout: float | None,
        ephemeral: bool,
        after: int,
    ) -> asyncio.Future[Any]:
        """The attempt of step ``key`` after attempt ``after`` (0: the first), which the
        code calls holding a slot for it: it starts that attempt (unless it ran already)
        and gives the step's value, raises its failure, or gives ``AttemptBackoff`` when
        the attempt failed and the step will retry. The step's own retry timer never
        starts an attempt of a queued step: only the code, admitted again, does."""
        entries = self.state.entries
        if after == 0:
            if not callable(fn):
                raise TypeError(f"ctx.step({key!r}, ...): {fn!r} is not callable")
            entry = self._visit(key, EntryKind.STEP)
        else:
            entry = entries.get(key)
        attempt = after + 1
        if entry is None or entry.attempt < attempt:
            # Not recorded in what still counts: numbered above what a reset set aside.
            attempt = max(attempt, self.state.attempt_floors.get(key, 0) + 1)
        if after == 0:
            # Recorded by a version that held one slot for every attempt: it goes on so.
            held = (
                entry is not None
                and entry.attempt > attempt
                and step_backoff_key(key, attempt) not in entries
            )
            self._intents[key] = StepIntent(
                fn, args, kwargs, retry or DEFAULT_RETRY, timeout, ephemeral, queued=not held
            )
            if held:
                return self._held_attempts(key, entry)
        assert self._loop is not None
        fut = self._loop.create_future()
        self._futures[key] = fut
        if step_backoff_key(key, attempt) in entries:
            fut.set_result(AttemptBackoff(attempt, None))  # replay: failed, backoff recorded
        elif entry is None:
            if key not in self._ephemeral:
                self._deferred.append(("step", key))
        elif entry.state.final:
            self._settle(fut, entry)
        elif entry.state is EntryState.BACKOFF:
            if entry.attempt >= attempt:
                fut.set_result(AttemptBackoff(entry.attempt, entry.fire_at_ms))
            else:
                self._deferred.append(("step", key))  # admitted again: the next attempt
        elif (key, entry.attempt) not in self.inflight:
            self._deferred.append(("step", key))  # lost with the previous owner
        return fut

    def _asking_again(self) -> bool:
        """Whether the code waits for a queue slot it asks for again, a reset or fork
        having given the first back (``engine.replay.slots``)."""
        entries = self.state.entries
        for slot, given_back in self.state.requeued.items():
            entry = entries.get(ask_key(slot, given_back))
            if entry is not None and entry.state is EntryState.WAITING:
                return True
        return False

    def _held_attempts(self, key: str, entry: Entry | None) -> asyncio.Future[Any]:
        """The step future of a queued step whose history held one slot for all its
        attempts (as ``step_future`` makes it)."""
        fut = self._future(entry, key)
        if entry is not None and (
            (entry.state is EntryState.RUNNING and (key, entry.attempt) not in self.inflight)
            or (
                entry.state is EntryState.BACKOFF
                and self._phase is Phase.RETRIES_DUE
                and self._overdue(entry)
            )
        ):
            self._deferred.append(("step", key))
        return fut

    def _backed_off(self, entry: Entry) -> None:
        """A queued step's attempt failed and the step will retry: its code gives the
        slot back and waits out the backoff (``engine.api.queues.queued_step``)."""
        fut = self._futures.get(entry.key)
        if fut is not None and not fut.done():
            fut.set_result(AttemptBackoff(entry.attempt, entry.fire_at_ms))

    def _queue_start(self, entry: Entry) -> StartWorkflow | None:
        """The start of the queue instance a request goes to, published before it: the
        first one makes the instance, every other one is a repeat of its command id and
        changes nothing."""
        target = entry.child_id or ""
        if entry.event_name != QUEUE_ACQUIRE or not target.startswith(QUEUE_INSTANCE_PREFIX):
            return None
        assert entry.result is not None
        request = self.decode_recorded(entry.result, f"the queue request {entry.key!r}")
        limits = request.get("limits") if isinstance(request, dict) else None
        return StartWorkflow(
            instance_id=target,
            command_id=f"queuestart:{target}",
            time_ms=self.clock.now_ms(),
            workflow=QUEUE_WORKFLOW,
            input=encode_safely(self.codec, {"limits": limits}),
        )

    def _publish_message(self, entry: Entry, message: Command) -> None:
        start = self._queue_start(entry)
        if start is not None:
            self._out.commands.append((self.state.instance_id, start))
        self._out.commands.append((self.state.instance_id, message))

    def _withdraw_from_queues(self) -> None:
        """Release every slot this instance asked for and did not give back (a cancel,
        a failure past a held slot, a losing race branch): the queue drops a waiter and
        frees a holder; a release of what it no longer knows changes nothing."""
        for key, entry in unreleased(self.state):
            assert entry.child_id is not None and entry.result is not None
            own = slot_token(key, self.state.run)
            try:
                request = decode_safely(self.codec, entry.result)
            except StepstreamError:
                # Sealed by a codec this engine lacks: a cancel must still free the slot,
                # under the token the request was made with.
                request = None
            token = request.get("key", key) if isinstance(request, dict) else own
            self._out.commands.append(
                (
                    self.state.instance_id,
                    SendEvent(
                        instance_id=entry.child_id,
                        command_id=message_command(self.state.instance_id, f"{own}#withdraw"),
                        time_ms=self.clock.now_ms(),
                        name=QUEUE_RELEASE,
                        payload=encode_safely(
                            self.codec, {"instance": self.state.instance_id, "key": token}
                        ),
                    ),
                )
            )

    def withdraw_again(self, out: Output) -> None:
        """Publish again what a finished instance withdrew from its queues. A restore
        asks for it when it folded the record that finished the instance: the commit
        that made that record may have kept it without its commands (a Kafka worker
        killed between the two), which would leave the slot held for good. The queue
        applies each withdrawal once (its command id), and one of a slot it no longer
        knows changes nothing."""
        if not self.state.status.finished:
            return
        self._out = out
        self._command_id = f"recover:{self.epoch}"
        self._withdraw_from_queues()
