"""Workflow hooks of one partition: the durable outbox of hook calls still owed, and the
runner that makes them.

A workflow declares ``@workflow(..., on_error=alert, on_status_change=audit)``. Each
history record that a hook reports (a ``StepFailed``; a record that changes the
instance's status) gets a task in the partition's state store (``state_keys.hook``)
written *before* the batch holding the record is committed (``write_ahead``), carrying
the event and the CRC-32 of the record. Once the batch is durable (``launch``) the task
runs; it is deleted when the hook returned, or when it failed ``attempts`` times (then
logged). So:

- hooks see only records committed now, never history a workflow replays;
- at least once: a task outlives a crash of its process, and the next start of this
  state store runs the tasks still there whose record is in the store's history (the
  CRC tells a record that became durable from one whose commit never finished: on Kafka
  the records of a commit reach the topic before the state store, and a crash between
  the two leaves records that restore folds in; their tasks were written ahead);
- a graceful hand-over or shutdown (``drain``) waits for the tasks owed, within the
  drain timeout; after ``stop`` (or ``halt``, when the partition is lost) nothing runs;
- on Kafka a worker that takes a partition over after its owner *crashed* does not run
  what that owner still owed: those tasks stay in the crashed worker's state directory
  and run when it owns the partition again. A new owner runs the hooks of what it
  commits itself. That directory is not fsynced (Kafka is the source of truth): tasks
  survive a killed process, not a lost machine or a directory rebuilt from the topics.

Hooks of one instance run one after another, in the order of its records; instances do
not wait for each other. Sync hooks run on threads (``consumers.hook_threads``), async ones
on the loop.
A hook that raises or overruns ``timeout_s`` is retried with doubling backoff, then
dropped with an error in the log: it never fails or holds up a workflow or the partition.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import zlib
from collections import OrderedDict, deque
from collections.abc import Awaitable, Mapping
from typing import Any

from stepstream.consumers import log_context
from stepstream.consumers import state_keys as keys
from stepstream.consumers.hook_tasks import (
    ERROR,
    MAX_HOOK_BACKOFF_S,
    STATUS,
    HookConfig,
    HookSubject,
    HookTask,
    error_event,
    status_after,
    status_event,
)
from stepstream.consumers.hook_threads import HookThreads
from stepstream.engine.api.hook_events import StatusChangeEvent, StepErrorEvent
from stepstream.engine.api.workflow import Registry, WorkflowDefinition
from stepstream.engine.errors import UnknownWorkflow
from stepstream.engine.replay.effects import Output
from stepstream.engine.replay.runtime import InstanceRuntime
from stepstream.engine.replay.state import InstanceState, Status
from stepstream.engine.replay.state_json import state_from_storage
from stepstream.engine.seams import CommitBatch, PartitionBackend, PartitionLost
from stepstream.engine.wire.records import (
    HistoryRecord,
    StepFailedRecord,
    WorkflowPaused,
    WorkflowResumed,
    WorkflowStarted,
)
from stepstream.engine.wire.serde import RecordSerde

log = logging.getLogger("stepstream.hooks")

# Statuses remembered per instance, so that a batch need not read the stored meta to
# know what status its first record changes from.
_STATUS_MEMORY = 100_000
_RETRY_FLUSH_S = 1.0


class HookRunner:
    """The hooks of one partition's processor: ``write_ahead`` before each commit,
    ``launch`` after it, ``drain``/``stop`` on hand-over, ``halt`` when it is lost."""

    def __init__(
        self,
        backend: PartitionBackend,
        registry: Registry,
        *,
        serde: RecordSerde,
        config: HookConfig | None = None,
    ) -> None:
        self._backend = backend
        self._registry = registry
        self._serde = serde
        self._config = config or HookConfig()
        self._staged: list[HookTask] = []
        self._staged_status: dict[str, Status] = {}
        # Each instance's status as last committed (for instances with a status hook).
        self._status: OrderedDict[str, Status] = OrderedDict()
        # Instances a pause caught pending, until their resume (``_paused_pending``).
        self._pending_pauses: set[str] = set()
        # Tasks queued, running, or done but not yet deleted from the store.
        self._known: set[bytes] = set()
        self._queues: dict[str, deque[HookTask]] = {}
        self._workers: set[asyncio.Task[None]] = set()
        self._done: list[bytes] = []
        self._flusher: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._loaded = False
        self._halted = False
        self._threads: HookThreads | None = None

    @property
    def owed(self) -> int:
        """Hook calls owed (queued, running, or done but not yet deleted)."""
        return len(self._known)

    # ---- the processor's calls ------------------------------------------------------

    async def write_ahead(self, out: Output, touched: Mapping[str, InstanceRuntime]) -> None:
        """Make the tasks of the records in ``out`` durable, before the batch with the
        records is committed. A task whose record never becomes durable is dropped at
        the next start (its CRC finds no such record)."""
        self._staged = []
        self._staged_status = {}
        status: dict[str, Status | None] = {}
        for record in out.history:
            runtime = touched.get(record.instance_id)
            if runtime is None:
                continue
            definition = runtime.definition
            if definition is None or not definition.has_hooks:
                continue
            task = self._task_for(record, definition, status, runtime.state)
            if task is not None:
                self._staged.append(task)
        for instance_id in status:
            runtime = touched[instance_id]
            self._staged_status[instance_id] = runtime.state.status
        if self._staged:
            batch = CommitBatch()
            for task in self._staged:
                batch.put(task.key, task.to_json())
            await self._backend.commit(batch)

    def launch(self) -> None:
        """The batch written after ``write_ahead`` is durable: run its tasks. The first
        call also runs the tasks an earlier run of this store left."""
        staged, self._staged = self._staged, []
        for instance_id, status in self._staged_status.items():
            self._remember(instance_id, status)
        self._staged_status = {}
        if self._halted:
            return
        if not self._loaded:
            self._loaded = True
            self._load()
        for task in staged:
            self._enqueue(task)

    async def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the calls owed; returns how many are left
        (their tasks stay in the store, for the next start of this store)."""
        if self._known and timeout > 0:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                pass
        left = len(self._known)
        if left:
            log.warning(
                "%d hook calls still owed after the drain timeout; they are made when this "
                "state (data or state directory) owns the partition again",
                left,
                extra={"partition": self._backend.partition},
            )
        return left

    def halt(self) -> None:
        """The partition is no longer ours: start nothing more (running async hooks are
        cancelled; a sync hook's thread cannot be, and what it returns is ignored)."""
        self._halted = True
        for worker in self._workers:
            worker.cancel()
        if self._flusher is not None:
            self._flusher.cancel()

    async def stop(self) -> None:
        """Stop running hooks; delete the tasks of those that finished, if the partition
        still takes commits."""
        self.halt()
        pending = [*self._workers, *([self._flusher] if self._flusher is not None else [])]
        for task in pending:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._done:
            batch = CommitBatch()
            for key in self._done:
                batch.delete(key)
            try:
                await self._backend.commit(batch)
            except Exception as exc:  # revoked already: the calls are made again later
                log.debug(
                    "hook tasks not deleted: %s", exc, extra={"partition": self._backend.partition}
                )
            self._done = []
        self._threads = None  # a call still running finishes on its own thread

    # ---- tasks ------------------------------------------------------------------------

    def _task_for(
        self,
        record: HistoryRecord,
        definition: WorkflowDefinition,
        status: dict[str, Status | None],
        state: InstanceState,
    ) -> HookTask | None:
        instance_id = record.instance_id
        event: StepErrorEvent | StatusChangeEvent
        if isinstance(record, StepFailedRecord):
            if definition.on_error is None:
                return None
            kind, event = ERROR, error_event(record, definition)
        else:
            if definition.on_status_change is None:
                return None
            old = status[instance_id] if instance_id in status else self._status_before(record)
            new = status_after(old, record, paused_pending=self._paused_pending(record, old))
            status[instance_id] = new
            if new.finished:
                self._pending_pauses.discard(instance_id)
            if new is old:
                return None
            kind, event = STATUS, status_event(record, definition, old, new)
        crc = zlib.crc32(self._serde.encode(record))
        run = (state.created_ms, state.traceparent)
        return HookTask(keys.hook(instance_id, record.seq), kind, crc, event, run)

    def _paused_pending(self, record: HistoryRecord, old: Status | None) -> bool:
        """Whether the pause that ``record`` resumes caught the instance pending (it
        goes back to pending); noted at the pause, or read from the committed meta."""
        instance_id = record.instance_id
        if isinstance(record, WorkflowPaused):
            if old is Status.PENDING:
                self._pending_pauses.add(instance_id)
            else:
                self._pending_pauses.discard(instance_id)
            return False
        if not isinstance(record, WorkflowResumed):
            return False
        if instance_id in self._pending_pauses:
            self._pending_pauses.discard(instance_id)
            return True
        meta = self._backend.store.get(keys.meta(instance_id))
        return meta is not None and state_from_storage(instance_id, meta, []).paused_pending

    def _status_before(self, record: HistoryRecord) -> Status | None:
        """The committed status of the record's instance (before the batch)."""
        if isinstance(record, WorkflowStarted):
            return None  # a new instance (or a forgotten id started again)
        known = self._status.get(record.instance_id)
        if known is not None:
            return known
        meta = self._backend.store.get(keys.meta(record.instance_id))
        if meta is None:
            return None
        return state_from_storage(record.instance_id, meta, []).status

    def _remember(self, instance_id: str, status: Status) -> None:
        self._status[instance_id] = status
        self._status.move_to_end(instance_id)
        if status.finished:
            del self._status[instance_id]  # it changes no more (a reused id starts anew)
        while len(self._status) > _STATUS_MEMORY:
            self._status.popitem(last=False)

    def _load(self) -> None:
        """Queue the tasks a previous run of this store left, in instance and record
        order; drop those whose record never became durable."""
        store = self._backend.store
        loaded = dropped = 0
        for key, value in store.scan(keys.HOOK):
            instance_id, seq = keys.split_hook(key)
            try:
                task = HookTask.from_json(key, value)
            except Exception:
                log.exception(
                    "hook task unreadable: dropped",
                    extra={
                        "instance_id": instance_id,
                        "seq": seq,
                        "partition": self._backend.partition,
                    },
                )
                self._forget(key)
                continue
            stored = store.get(keys.history(instance_id, seq))
            if stored is None or zlib.crc32(stored) != task.crc:
                dropped += 1
                self._forget(key)
                continue
            loaded += 1
            self._enqueue(task)
        if loaded or dropped:
            log.info(
                "%d hook calls owed from before this start (%d dropped: their records were "
                "never committed)",
                loaded,
                dropped,
                extra={"partition": self._backend.partition},
            )

    def _enqueue(self, task: HookTask) -> None:
        if task.key in self._known:
            return
        self._known.add(task.key)
        self._idle.clear()
        queue = self._queues.get(task.instance_id)
        if queue is not None:
            queue.append(task)
            return
        queue = self._queues[task.instance_id] = deque([task])
        worker = asyncio.get_running_loop().create_task(self._serve(task.instance_id, queue))
        self._workers.add(worker)
        worker.add_done_callback(self._workers.discard)

    async def _serve(self, instance_id: str, queue: deque[HookTask]) -> None:
        try:
            while queue:
                task = queue[0]
                # This worker's own context: the runner's lines about the call, and the
                # hook's own (an async hook's task copies it; a sync one's thread is given
                # it), name the instance and its run's trace.
                log_context.current.set(HookSubject(task, self._backend.partition))
                try:
                    await self._run(task)
                except Exception:  # a bug here must not keep the task owed for ever
                    log.exception(
                        "hook runner failed", extra=task.log_fields(self._backend.partition)
                    )
                queue.popleft()
                self._forget(task.key)
        finally:
            if self._queues.get(instance_id) is queue:
                del self._queues[instance_id]

    def _forget(self, key: bytes) -> None:
        """The task is done with: delete it from the store (in the background)."""
        self._known.add(key)  # until the delete is committed
        self._idle.clear()
        self._done.append(key)
        if self._halted:
            return
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._done and not self._halted:
            batch = CommitBatch()
            done, self._done = self._done, []
            for key in done:
                batch.delete(key)
            try:
                await self._backend.commit(batch)
            except asyncio.CancelledError:
                self._done[:0] = done  # for ``stop`` to delete
                raise
            except PartitionLost:
                self.halt()
                return
            except Exception as exc:
                log.warning(
                    "deleting %d finished hook tasks failed (%s); retrying",
                    len(done),
                    exc,
                    extra={"partition": self._backend.partition},
                )
                self._done[:0] = done
                await asyncio.sleep(_RETRY_FLUSH_S)
                continue
            self._known.difference_update(done)
            if not self._known:
                self._idle.set()

    # ---- calling a hook ---------------------------------------------------------------

    async def _run(self, task: HookTask) -> None:
        hook = self._hook(task)
        if hook is None:
            return
        config = self._config
        for attempt in range(1, config.attempts + 1):
            error = await self._call(hook, task.event)
            if error is None:
                return
            if attempt == config.attempts:
                log.error(
                    "hook failed, dropped after %d attempts: %s: %s",
                    config.attempts,
                    type(error).__name__,
                    error,
                    exc_info=error,
                    extra={**task.log_fields(self._backend.partition), "attempt": attempt},
                )
                return
            delay = min(config.backoff_s * 2 ** (attempt - 1), MAX_HOOK_BACKOFF_S)
            log.warning(
                "hook failed, retrying in %.1f s: %s: %s",
                delay,
                type(error).__name__,
                error,
                extra={**task.log_fields(self._backend.partition), "attempt": attempt},
            )
            await asyncio.sleep(delay)

    def _hook(self, task: HookTask) -> Any:
        event = task.event
        try:
            definition = self._registry.resolve(event.workflow, event.version)
        except UnknownWorkflow:
            log.warning(
                "hook dropped: its workflow version is not deployed here",
                extra=task.log_fields(self._backend.partition),
            )
            return None
        hook = definition.on_error if task.kind == ERROR else definition.on_status_change
        if hook is None:
            log.info(
                "hook dropped: the deployed workflow no longer has it",
                extra=task.log_fields(self._backend.partition),
            )
        return hook

    async def _call(
        self, hook: Any, event: StepErrorEvent | StatusChangeEvent
    ) -> BaseException | None:
        """Call the hook once; what it raised (a timeout: ``TimeoutError``), or None.
        Whatever a hook raises is its failure, ``SystemExit`` and a ``CancelledError``
        of its own too: a hook never stops the engine nor the calls owed after it."""
        timeout = self._config.timeout_s or None
        try:
            if inspect.iscoroutinefunction(hook):
                await asyncio.wait_for(_guarded(hook(event)), timeout)
                return None
            if self._threads is None:
                self._threads = HookThreads(
                    self._config.threads, f"stepstream-hook-{self._backend.partition}"
                )
            result = await self._threads.call(hook, event, timeout)
            if inspect.isawaitable(result):
                await asyncio.wait_for(_guarded(result), timeout)
        except asyncio.CancelledError as exc:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the runner itself is being stopped
            return exc
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            return exc
        return None


class HookExited(Exception):
    """A hook raised ``SystemExit`` or ``KeyboardInterrupt`` (a library it called gave
    up): its call failed, like any other exception."""


async def _guarded(call: Awaitable[Any]) -> Any:
    """``call``, with ``SystemExit`` and ``KeyboardInterrupt`` turned into ``HookExited``
    inside its task: asyncio lets those two out of a task and stops the event loop."""
    try:
        return await call
    except (SystemExit, KeyboardInterrupt) as exc:
        raise HookExited(f"the hook raised {type(exc).__name__}: {exc}") from exc
