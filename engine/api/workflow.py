"""Workflow definitions and the registry that maps names (and versions) to code."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from stepstream.engine.api.durations import duration_problem
from stepstream.engine.api.hook_events import ErrorHook, StatusHook
from stepstream.engine.api.queues import QUEUE_WORKFLOW, Queue
from stepstream.engine.errors import DuplicateWorkflow, UnknownWorkflow
from stepstream.engine.wire.names import name_problem

if TYPE_CHECKING:
    from stepstream.engine.api.context import Context

WorkflowFn = Callable[["Context", Any], Awaitable[Any]]
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

_DEFINITION_ATTR = "__stepstream_workflow__"


@dataclass(frozen=True, slots=True)
class WorkflowDefinition:
    name: str
    version: str
    fn: WorkflowFn
    on_error: ErrorHook | None = None
    on_status_change: StatusHook | None = None
    # The whole run's limit in seconds (``@workflow(timeout=)``); None: no limit.
    timeout: float | None = None
    # Instances wait (status pending) until this queue admits them.
    queue: Queue | None = None

    @property
    def has_hooks(self) -> bool:
        return self.on_error is not None or self.on_status_change is not None


def workflow(
    name: str,
    *,
    version: str = "1",
    on_error: ErrorHook | None = None,
    on_status_change: StatusHook | None = None,
    timeout: float | timedelta | None = None,
    queue: Queue | None = None,
) -> Callable[[F], F]:
    """Mark an ``async def fn(ctx, input)`` as a workflow named ``name``.

    Registration happens when a worker loads the module (``--workflows``) or when the
    function is passed to ``Worker``/``Client``; the decorator itself has no global effect.
    Several versions of one name may be deployed side by side (``Registry``).

    ``on_error(StepErrorEvent)`` is called for every failed step attempt and
    ``on_status_change(StatusChangeEvent)`` for every status change of an instance of
    this version: after the fact is durable, never on replay, at least once; sync hooks
    run on a thread, async ones on the loop. A hook that raises is retried a few times,
    then logged and dropped; it never affects the workflow.

    ``timeout`` (seconds or a ``timedelta``) limits the whole run: a durable timer is set
    when an instance starts, and if the run has not finished when it fires, the instance
    fails with ``WorkflowTimeout`` (running step attempts are given up, children
    cancelled). A run that finishes first cancels the timer.
    ``queue``: a ``Queue`` whose limits every instance runs within: an instance waits
    with status ``pending`` until the queue admits it, and frees its slot when it ends
    (``client.start(..., priority=, queue_key=)`` orders and groups the waiters).
    """
    if not name or "/" in name:
        raise ValueError(f"workflow name {name!r} must be non-empty and must not contain '/'")
    problem = name_problem(str(version))
    if problem is not None:
        raise ValueError(f"workflow {name!r}: version {str(version)!r} {problem}")
    for what, hook in (("on_error", on_error), ("on_status_change", on_status_change)):
        if hook is not None and not callable(hook):
            raise TypeError(f"workflow {name!r}: {what}={hook!r} is not callable")
    if queue is not None and not isinstance(queue, Queue):
        raise TypeError(f"workflow {name!r}: queue={queue!r} is not a stepstream.Queue")

    limit = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if timeout is not None:
        problem = duration_problem(timeout)
        if problem is None and not limit > 0:  # type: ignore[operator]
            problem = "must be a positive number of seconds or a timedelta"
        if problem is not None:
            raise ValueError(f"workflow {name!r}: timeout={timeout!r} {problem}")

    def mark(fn: F) -> F:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"workflow {name!r}: {fn.__qualname__} must be an 'async def'")
        definition = WorkflowDefinition(
            name,
            str(version),
            fn,
            on_error,
            on_status_change,
            None if limit is None else float(limit),
            queue,
        )
        setattr(fn, _DEFINITION_ATTR, definition)
        return cast(F, fn)

    return mark


def definition_of(obj: object) -> WorkflowDefinition | None:
    found = getattr(obj, _DEFINITION_ATTR, None)
    return found if isinstance(found, WorkflowDefinition) else None


def ordered_versions(versions: Iterable[str]) -> list[str]:
    """``versions`` (in order of declaration) from oldest to latest: by value when every
    one is a whole number ("9" before "10"), else as declared."""
    declared = list(dict.fromkeys(versions))
    if declared and all(_is_number(v) for v in declared):
        # sorted() is stable: equal numbers ("1", "01") keep their order of declaration.
        return sorted(declared, key=int)
    return declared


def _is_number(version: str) -> bool:
    return version.isascii() and version.isdigit()


def _where(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


class Registry:
    """Workflows a worker can run. Several versions of one name may be registered; new
    instances take the latest (the highest number when every version of the name is a
    whole number, else the one declared last) unless a client pins a version, and
    instances stay on the version they started with."""

    def __init__(self, workflows: Iterable[object] = ()) -> None:
        # Versions in order of declaration (dicts keep insertion order).
        self._by_name: dict[str, dict[str, WorkflowDefinition]] = {}
        self._latest: dict[str, WorkflowDefinition] = {}
        for wf in workflows:
            self.add(wf)

    def add(self, wf: object) -> WorkflowDefinition:
        """Register ``wf``; registering the very same function again does nothing, another
        function with the same name and version raises ``DuplicateWorkflow``."""
        definition = wf if isinstance(wf, WorkflowDefinition) else definition_of(wf)
        if definition is None:
            raise TypeError(f"{wf!r} is not decorated with @workflow")
        if definition.name.startswith(RESERVED_PREFIX):
            raise DuplicateWorkflow(
                f"workflow name {definition.name!r} is reserved: names starting with "
                f"{RESERVED_PREFIX!r} are the engine's own (schedules); rename it"
            )
        versions = self._by_name.setdefault(definition.name, {})
        existing = versions.get(definition.version)
        if existing is not None:
            if existing.fn is definition.fn:
                return existing  # the same module loaded twice, or one function listed twice
            raise DuplicateWorkflow(
                f"workflow {definition.name!r} version {definition.version!r} is defined twice: "
                f"by {_where(existing.fn)} and by {_where(definition.fn)}; give one of them "
                "another version (@workflow(name, version=...)) or load only one"
            )
        versions[definition.version] = definition
        self._latest[definition.name] = versions[ordered_versions(versions)[-1]]
        return definition

    def add_module(self, module_name: str) -> list[WorkflowDefinition]:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UnknownWorkflow(
                f"cannot import workflow module {module_name!r}: {exc}; "
                "check --workflows and that the module is on PYTHONPATH"
            ) from None
        found = [d for d in map(definition_of, vars(module).values()) if d is not None]
        if not found:
            raise UnknownWorkflow(f"module {module_name!r} defines no @workflow functions")
        return [self.add(d) for d in found]

    def add_modules(self, spec: str | Iterable[str]) -> None:
        """Modules named comma-separated (``"shop.flows,shop.more"``) or as a list."""
        names = spec.split(",") if isinstance(spec, str) else list(spec)
        for name in names:
            if not isinstance(name, str):
                raise TypeError(
                    f"modules are named by strings ('shop.flows'), got {type(name).__name__}"
                )
            if name.strip():
                self.add_module(name.strip())

    def resolve(self, name: str, version: str | None = None) -> WorkflowDefinition:
        if name == QUEUE_WORKFLOW:
            # The engine's own: every worker runs queue instances, whatever it loaded.
            from stepstream.engine.api.queue_service import QUEUE_DEFINITION

            return QUEUE_DEFINITION
        versions = self._by_name.get(name)
        if not versions and name.startswith(RESERVED_PREFIX):
            versions = builtin_workflows().get(name)
            if versions and version is None:
                return versions[ordered_versions(versions)[-1]]
        if not versions:
            known = ", ".join(sorted(self._by_name)) or "none"
            raise UnknownWorkflow(
                f"unknown workflow {name!r} (registered: {known}); "
                "register it with @workflow and load its module where the engine runs "
                "(`--workflows MOD` of the command that runs it, or STEPSTREAM_WORKFLOWS)"
            )
        if version is None:
            return self._latest[name]
        try:
            return versions[version]
        except KeyError:
            raise UnknownWorkflow(
                f"unknown workflow {name!r} version {version!r} (registered versions: "
                f"{', '.join(ordered_versions(versions))}); pin one of those, or deploy that "
                "version (keep old versions deployed until their instances finish)"
            ) from None

    def names(self, *, builtin: bool = False) -> dict[str, list[str]]:
        """Each workflow's versions, oldest to latest (the last is what new instances get);
        with ``builtin``, the engine's own workflows too (every worker runs them)."""
        found = dict(self._by_name)
        if builtin:
            found.update(builtin_workflows())
        return {name: ordered_versions(v) for name, v in sorted(found.items())}


# Names of the engine's own workflows, which every registry runs and users cannot take.
RESERVED_PREFIX = "stepstream."


def builtin_workflows() -> dict[str, dict[str, WorkflowDefinition]]:
    """The engine's own workflows, by name and version (imported on first use: they are
    written with this module's decorator)."""
    from stepstream.engine.api.schedules import run_schedule

    definition = definition_of(run_schedule)
    assert definition is not None
    return {definition.name: {definition.version: definition}}
