"""What happens when applying an input to an instance goes wrong, so that one instance's
trouble never stops its partition.

- An internal error (a bug; user exceptions stay inside the workflow task) undoes every
  decision of that instance in the batch, forgets its runtime and has it reloaded and
  driven from its committed state after the commit.
- History that no longer matches the code parks the instance: nothing the replay
  decided is kept, its inputs are still recorded, and a worker with matching code
  drives it on when it loads it.
"""

from __future__ import annotations

import logging

from stepstream.consumers.log_context import InstanceSubject, instance_fields
from stepstream.consumers.partition.batch import Batch
from stepstream.consumers.runtime_cache import RuntimeCache
from stepstream.engine.errors import HistoryDiverged
from stepstream.engine.replay.effects import StepOutcome
from stepstream.engine.replay.runtime import InstanceRuntime
from stepstream.engine.wire.records import Command

log = logging.getLogger("stepstream.partition")


class Containment:
    def __init__(self, cache: RuntimeCache, partition: int) -> None:
        self._cache = cache
        self._partition = partition
        # What lines logged while an input is applied are about (``Applier.batch``).
        self.subject = InstanceSubject(partition)

    def handle(
        self, runtime: InstanceRuntime, msg: Command | StepOutcome, batch: Batch
    ) -> str | None:
        """Apply ``msg``; None when it took effect (or parked the instance), else why not.
        Lines logged meanwhile (the workflow code's too) are about the instance."""
        subject = self.subject
        subject.state = runtime.state
        try:
            runtime.handle(msg, batch.out)
        except HistoryDiverged as exc:
            return self.park(runtime, exc, batch, msg)
        except Exception as exc:
            return self._undo(runtime, msg, batch, exc)
        finally:
            subject.state = None
        batch.touched[runtime.state.instance_id] = runtime
        return None

    def _undo(
        self, runtime: InstanceRuntime, msg: Command | StepOutcome, batch: Batch, exc: Exception
    ) -> str:
        log.exception(
            "internal error while applying %s",
            type(msg).__name__,
            extra=instance_fields(runtime.state, self._partition),
        )
        # Undo every decision of this instance in the batch, not only this input's: its
        # in-memory state is gone, so its earlier records would have no state.
        instance_id = runtime.state.instance_id
        # Attempts started before this batch still run: whoever reloads the instance must
        # wait for them rather than count them lost.
        started_here = {
            (x.key, x.attempt) for x in batch.out.launches if x.instance_id == instance_id
        }
        running = runtime.inflight - started_here
        if isinstance(msg, StepOutcome):
            # Its attempt ended: recovery records it as lost (its outcome is gone).
            running.discard((msg.key, msg.attempt))
        self._cache.orphaned.setdefault(instance_id, set()).update(running)
        batch.strip(instance_id)
        self._cache.drop(instance_id)
        batch.redrive.add(instance_id)
        if batch.touched.pop(instance_id, None) is not None:
            batch.poisoned.add(instance_id)
        return f"internal error while applying {type(msg).__name__}: {exc!r}"

    def park(
        self,
        runtime: InstanceRuntime,
        diverged: HistoryDiverged,
        batch: Batch,
        msg: Command | StepOutcome | None,
    ) -> str | None:
        """The code no longer matches the instance's history: keep nothing the replay
        decided, and park the instance (status stays running, its ``error`` says where it
        diverged). ``msg`` is still recorded, so nothing is lost."""
        instance_id = runtime.state.instance_id
        running = set(runtime.inflight)
        batch.strip(instance_id)
        self._cache.drop(instance_id)
        parked = self._cache.load(instance_id)
        reason = f"{diverged.parked_as}: {diverged}"
        if parked is None:
            return reason
        parked.inflight |= running
        parked.park(reason)
        if msg is not None:
            try:
                parked.handle(msg, batch.out)
            except Exception as exc:
                log.exception(
                    "internal error while applying %s",
                    type(msg).__name__,
                    extra=instance_fields(parked.state, self._partition),
                )
                batch.strip(instance_id)
                self._cache.drop(instance_id)
                return f"internal error while applying {type(msg).__name__}: {exc!r}"
        batch.touched[instance_id] = parked
        log.warning(
            "instance parked: %s; %s (stepstream list --diverged)",
            diverged,
            diverged.advice,
            extra=instance_fields(parked.state, self._partition),
        )
        return None
