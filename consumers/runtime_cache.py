"""The live instances of one partition: a least-recently-used cache of runtimes, so a step
costs O(1) and replay happens only after eviction or a restart.

It also owns how a runtime is built from committed state: which definition it runs (an
instance whose version is not deployed here is parked with that said in its status) and
which of its attempts still run (after an internal error dropped its runtime)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from stepstream.consumers.instance_store import load_state, load_states
from stepstream.consumers.telemetry import Telemetry
from stepstream.engine.api.workflow import Registry, WorkflowDefinition
from stepstream.engine.errors import UnknownWorkflow
from stepstream.engine.replay.reset import HistoryAccess
from stepstream.engine.replay.runtime import InstanceRuntime
from stepstream.engine.replay.state import InstanceState
from stepstream.engine.seams import Clock, StateStore
from stepstream.engine.wire.codec import PayloadCodec

log = logging.getLogger("stepstream.partition")


class RuntimeCache:
    def __init__(
        self,
        store: StateStore,
        registry: Registry,
        *,
        partition: int,
        codec: PayloadCodec,
        clock: Clock,
        epoch: int,
        max_payload_bytes: int,
        size: int,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._store = store
        self._registry = registry
        self._partition = partition
        self._codec = codec
        self._clock = clock
        self._epoch = epoch
        self._max_payload_bytes = max_payload_bytes
        self._size = size
        self._telemetry = telemetry or Telemetry()
        self._runtimes: OrderedDict[str, InstanceRuntime] = OrderedDict()
        self._missing_versions: set[tuple[str, str]] = set()
        # Attempts still running for instances whose runtime an internal error dropped:
        # whoever loads the instance again waits for their outcomes.
        self.orphaned: dict[str, set[tuple[str, int]]] = {}
        self.draining = False
        # The stored history, for resets and forks (the partition's applier sets it).
        self.history: HistoryAccess | None = None
        # States read ahead for the batch being made (``preload``; None: no such
        # instance), each taken by the first ``load`` of its instance; dropped when the
        # batch is made.
        self._preloaded: dict[str, InstanceState | None] = {}

    def __len__(self) -> int:
        return len(self._runtimes)

    def __iter__(self) -> Iterator[InstanceRuntime]:
        return iter(self._runtimes.values())

    def peek(self, instance_id: str) -> InstanceRuntime | None:
        """The cached runtime, leaving the recency order as it is."""
        return self._runtimes.get(instance_id)

    def get(self, instance_id: str) -> InstanceRuntime | None:
        """The cached runtime, now the most recently used (eviction takes the least)."""
        runtime = self._runtimes.get(instance_id)
        if runtime is not None:
            self._runtimes.move_to_end(instance_id)
        return runtime

    def get_or_load(self, instance_id: str) -> InstanceRuntime | None:
        runtime = self.get(instance_id)
        if runtime is not None:
            self._telemetry.cache_hits += 1
            return runtime
        self._telemetry.cache_misses += 1
        return self.load(instance_id)

    def preload(self, instance_ids: Iterable[str]) -> None:
        """Read ahead, in one go, the committed state of those of ``instance_ids`` that
        are not in memory, for the loads of the batch being made: due timers of evicted
        sleepers (or commands to them) then cost one multi-get and one ordered scan
        together instead of four reads each. Call ``forget_preloaded`` when the batch is
        made, before anything is committed: a state read ahead is the committed one only
        until the next commit."""
        runtimes = self._runtimes
        wanted = [i for i in dict.fromkeys(instance_ids) if i not in runtimes]
        if len(wanted) > 1:  # one alone is read as before
            self._preloaded.update(load_states(self._store, wanted))

    def forget_preloaded(self) -> None:
        self._preloaded.clear()

    def load(self, instance_id: str) -> InstanceRuntime | None:
        """A runtime built from committed state (its coroutine replays on first drive)."""
        if instance_id in self._preloaded:
            state = self._preloaded.pop(instance_id)
        else:
            state = load_state(self._store, instance_id)
        if state is None:
            return None
        runtime = self.new(state, self._definition(state))
        runtime.inflight |= self.orphaned.pop(instance_id, set())
        return runtime

    def new(self, state: InstanceState, definition: WorkflowDefinition | None) -> InstanceRuntime:
        runtime = InstanceRuntime(
            state,
            definition,
            codec=self._codec,
            clock=self._clock,
            epoch=self._epoch,
            max_payload_bytes=self._max_payload_bytes,
        )
        runtime.draining = self.draining
        runtime.history = self.history
        self._runtimes[state.instance_id] = runtime
        return runtime

    def drop(self, instance_id: str) -> InstanceRuntime | None:
        """Take a runtime out of the cache and close its coroutine."""
        runtime = self._runtimes.pop(instance_id, None)
        if runtime is not None:
            runtime.close()
        return runtime

    def clear(self) -> None:
        for runtime in self._runtimes.values():
            runtime.close()
        self._runtimes.clear()

    def drain(self) -> None:
        """From now on, attempts that run may finish but no new one starts."""
        self.draining = True
        for runtime in self._runtimes.values():
            runtime.draining = True

    def running_attempts(self) -> int:
        return sum(len(runtime.inflight) for runtime in self._runtimes.values())

    def evict(self) -> None:
        """Close least recently used runtimes over the size; busy ones stay."""
        excess = len(self._runtimes) - self._size
        if excess <= 0:
            return
        for instance_id in list(self._runtimes)[: excess * 2]:
            runtime = self._runtimes[instance_id]
            if not runtime.busy:
                runtime.close()
                del self._runtimes[instance_id]
                excess -= 1
                if excess <= 0:
                    return

    def _definition(self, state: InstanceState) -> WorkflowDefinition | None:
        try:
            definition = self._registry.resolve(state.workflow, state.version)
        except UnknownWorkflow as exc:
            if not state.status.finished:
                state.parked = (
                    f"workflow {state.workflow!r} version {state.version!r} is not deployed "
                    f"on the worker that owns partition {self._partition}: the instance waits "
                    "until a worker with that version runs it"
                )
            if (state.workflow, state.version) not in self._missing_versions:
                self._missing_versions.add((state.workflow, state.version))
                log.error(
                    "instances of %s v%s cannot advance: %s",
                    state.workflow,
                    state.version,
                    exc,
                    extra={"partition": self._partition, "workflow": state.workflow},
                )
            return None
        state.parked = ""
        return definition
