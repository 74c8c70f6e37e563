"""Workflow definitions and the registry that maps names (and versions) to code."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from engine.errors import UnknownWorkflow

if TYPE_CHECKING:
    from engine.context import Context

WorkflowFn = Callable[["Context", Any], Awaitable[Any]]
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

_DEFINITION_ATTR = "__stepstream_workflow__"


@dataclass(frozen=True, slots=True)
class WorkflowDefinition:
    name: str
    version: str
    fn: WorkflowFn


def workflow(name: str, *, version: str = "1") -> Callable[[F], F]:
    """Mark an ``async def fn(ctx, input)`` as a workflow named ``name``.

    Registration happens when a worker loads the module (``--workflows``) or when the
    function is passed to ``Worker``/``Client``; the decorator itself has no global effect.
    """
    if not name or "/" in name:
        raise ValueError(f"workflow name {name!r} must be non-empty and must not contain '/'")

    def mark(fn: F) -> F:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"workflow {name!r}: {fn.__qualname__} must be an 'async def'")
        setattr(fn, _DEFINITION_ATTR, WorkflowDefinition(name, str(version), fn))
        return cast(F, fn)

    return mark


def definition_of(obj: object) -> WorkflowDefinition | None:
    found = getattr(obj, _DEFINITION_ATTR, None)
    return found if isinstance(found, WorkflowDefinition) else None


class Registry:
    """Workflows a worker can run. Several versions of one name may be registered;
    new instances take the latest registered, old ones stay pinned to theirs."""

    def __init__(self, workflows: Iterable[object] = ()) -> None:
        self._by_name: dict[str, dict[str, WorkflowDefinition]] = {}
        self._latest: dict[str, WorkflowDefinition] = {}
        for wf in workflows:
            self.add(wf)

    def add(self, wf: object) -> WorkflowDefinition:
        definition = wf if isinstance(wf, WorkflowDefinition) else definition_of(wf)
        if definition is None:
            raise TypeError(f"{wf!r} is not decorated with @workflow")
        versions = self._by_name.setdefault(definition.name, {})
        versions[definition.version] = definition
        self._latest[definition.name] = definition
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

    def add_modules(self, spec: str) -> None:
        for name in (part.strip() for part in spec.split(",")):
            if name:
                self.add_module(name)

    def resolve(self, name: str, version: str | None = None) -> WorkflowDefinition:
        versions = self._by_name.get(name)
        if not versions:
            known = ", ".join(sorted(self._by_name)) or "none"
            raise UnknownWorkflow(
                f"unknown workflow {name!r} (registered: {known}); "
                "register it with @workflow and load its module where the engine runs "
                "(`--workflows MOD` of stepstream dev/worker, or STEPSTREAM_WORKFLOWS)"
            )
        if version is None:
            return self._latest[name]
        try:
            return versions[version]
        except KeyError:
            raise UnknownWorkflow(
                f"workflow {name!r} has no version {version!r} registered "
                f"(registered: {', '.join(sorted(versions))}); keep old versions deployed "
                "until their instances finish"
            ) from None

    def names(self) -> dict[str, list[str]]:
        return {name: sorted(v) for name, v in sorted(self._by_name.items())}
