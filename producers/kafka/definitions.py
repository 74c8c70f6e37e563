"""Which workflows exist for a prefix: the ``<prefix>.definitions`` topic.

Every worker writes one ``WorkflowRegistered`` record (Avro, ``engine.wire.cluster_serde``) per
workflow version it loads when it starts, keyed by ``[name, version]`` as JSON, on a
compacted topic of one partition. Records stay after the worker stops, so a client checks
a workflow name without any worker running: a name no worker ever registered is refused
with ``UnknownWorkflow``; a registered one is published and runs once a worker owns its
partition.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from dataclasses import dataclass
from typing import Any

from stepstream.engine.api.workflow import (
    RESERVED_PREFIX,
    Registry,
    WorkflowDefinition,
    ordered_versions,
)
from stepstream.engine.errors import UndecodableRecord, UnknownWorkflow
from stepstream.engine.wire.cluster_serde import WORKFLOW_REGISTERED, cluster_serde
from stepstream.producers.kafka.follower import TopicFollower

log = logging.getLogger("stepstream.kafka.definitions")


@dataclass(frozen=True, slots=True)
class Registration:
    name: str
    version: str
    code_hash: str
    registered_at_ms: int
    latest: bool
    worker_id: str

    @property
    def key(self) -> bytes:
        return json.dumps([self.name, self.version]).encode()

    def encode(self) -> bytes:
        return cluster_serde().encode(
            WORKFLOW_REGISTERED,
            {
                "name": self.name,
                "version": self.version,
                "code_hash": self.code_hash,
                "registered_at_ms": self.registered_at_ms,
                "latest": self.latest,
                "worker_id": self.worker_id,
            },
        )

    @classmethod
    def decode(cls, raw: bytes) -> Registration:
        name, body = cluster_serde().decode(raw)
        if name != WORKFLOW_REGISTERED:
            raise UndecodableRecord(f"a {name} record, not {WORKFLOW_REGISTERED}")
        return cls(**body)


def code_hash(definition: WorkflowDefinition) -> str:
    """SHA-256 of the workflow function's source, or "" where there is none to read."""
    try:
        source = inspect.getsource(definition.fn)
    except (OSError, TypeError):
        return ""
    return hashlib.sha256(source.encode()).hexdigest()


def registrations(registry: Registry, worker_id: str, now_ms: int) -> list[Registration]:
    """What a worker with ``registry`` writes when it starts: every version it runs (the
    engine's own workflows too, so clients may start schedules)."""
    out = []
    for name, versions in registry.names(builtin=True).items():
        latest = registry.resolve(name).version
        for version in versions:
            definition = registry.resolve(name, version)
            out.append(
                Registration(
                    name, version, code_hash(definition), now_ms, version == latest, worker_id
                )
            )
    return out


@dataclass(frozen=True, slots=True)
class RemoteWorkflow:
    """A registered workflow; ``version`` None lets the worker that applies the start pick
    its latest."""

    name: str
    version: str | None


class DefinitionsView:
    """``await DefinitionsView.open(topic, prefix=, timeout=, **aiokafka_options)``."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._versions: dict[str, dict[str, Registration]] = {}
        self._follower: TopicFollower | None = None

    @classmethod
    async def open(
        cls, topic: str, *, prefix: str, timeout: float, **options: Any
    ) -> DefinitionsView:
        view = cls(prefix)
        view._follower = await TopicFollower.open(topic, view._apply, timeout=timeout, **options)
        return view

    async def close(self) -> None:
        if self._follower is not None:
            await self._follower.close()

    def knows(self, workflow: str, version: str | None = None) -> bool:
        versions = self._versions.get(workflow, {})
        return bool(versions) if version is None else version in versions

    @property
    def empty(self) -> bool:
        return not self._versions

    async def changed(self, timeout: float) -> bool:
        assert self._follower is not None
        return await self._follower.changed(timeout)

    async def synced(self, timeout: float) -> None:
        assert self._follower is not None
        await self._follower.synced(timeout)

    def resolve(self, workflow: str, version: str | None = None) -> RemoteWorkflow:
        """The workflow to start (``UnknownWorkflow`` if no worker ever registered the
        name, or the pinned version)."""
        versions = self._versions.get(workflow)
        if not versions:
            # The engine's own workflows (schedules) are not the user's to start.
            known = (
                ", ".join(sorted(n for n in self._versions if not n.startswith(RESERVED_PREFIX)))
                or "none"
            )
            raise UnknownWorkflow(
                f"unknown workflow {workflow!r}: no worker of prefix {self._prefix!r} has "
                f"ever registered it (known workflows: {known}). A worker must have started "
                "once with the module that defines it: `stepstream worker --workflows "
                "MODULE ...`; after that, starts are accepted even while no worker runs"
            )
        if version is not None and version not in versions:
            raise UnknownWorkflow(
                f"unknown workflow {workflow!r} version {version!r}: no worker of prefix "
                f"{self._prefix!r} has registered it (versions: "
                f"{', '.join(ordered_versions(versions))}); pin one of those, or start a "
                "worker with that version in its --workflows"
            )
        return RemoteWorkflow(workflow, version)

    def _apply(self, key: bytes, value: bytes | None, time_ms: int) -> None:
        if value is None:
            try:
                name, version = json.loads(key)
            except (ValueError, TypeError):
                return
            self._versions.get(str(name), {}).pop(str(version), None)
            if not self._versions.get(str(name), True):
                del self._versions[str(name)]
            return
        try:
            registration = Registration.decode(value)
        except UndecodableRecord as exc:
            log.warning("skipping a definitions record (key %r): %s", key, exc)
            return
        self._versions.setdefault(registration.name, {})[registration.version] = registration
