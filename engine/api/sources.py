"""Event sources: the declaration that a user's Kafka topic feeds workflows.

A workflow module declares, beside its workflows::

    orders = Source("shop.orders", start=order, instance_id="key")
    paid = Source("shop.payments", event="paid", instance_id="field:order.id")

and every worker that loads the module consumes the topic (consumer group
``<prefix>.sources``), turning each record into a ``StartWorkflow`` (``start=``) or a
``SendEvent`` (``event=``) whose command id is ``topic/partition/offset``. This module
only holds and checks the declaration; reading records is ``consumers.sources``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, cast

from stepstream.engine.api.workflow import Registry, definition_of
from stepstream.engine.wire.names import event_name_problem, name_problem

SourceFormat = Literal["json", "avro", "bytes"]
FORMATS: tuple[SourceFormat, ...] = ("json", "avro", "bytes")
AvroSchema = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Correlation:
    """Where a record's instance id is: its key, one of its headers, or a field of its
    value (a dotted path into a JSON object or an Avro record)."""

    kind: Literal["key", "header", "field"]
    name: str = ""

    @classmethod
    def parse(cls, text: str) -> Correlation:
        if text == "key":
            return cls("key")
        kind, sep, name = text.partition(":")
        if sep and name and kind in ("header", "field"):
            if kind == "field" and any(not part for part in name.split(".")):
                raise ValueError(f"instance_id={text!r}: a field path is names joined by '.'")
            return cls(cast(Literal["header", "field"], kind), name)
        raise ValueError(
            f"instance_id={text!r} is not one of 'key', 'header:<name>' or "
            "'field:<path>' (e.g. 'field:order.id')"
        )

    def __str__(self) -> str:
        return "key" if self.kind == "key" else f"{self.kind}:{self.name}"

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.name.split(".")) if self.kind == "field" else ()


class Source:
    """A Kafka topic whose records start a workflow or are sent to instances as events.

    ``start=`` a workflow (its name or the ``@workflow`` function) or ``event=`` an event
    name: exactly one of them. ``instance_id`` says where each record's instance id is:
    ``"key"`` (the default), ``"header:<name>"`` or ``"field:<path>"``. ``format`` is how
    record values are written: ``"json"``; ``"avro"``, either single-object encoded
    (marker ``C3 01`` and the writer schema's fingerprint) or in Confluent's wire format
    (byte 0 and a 4-byte schema id), with the writer schemas given as ``schemas=``: a list
    for single-object records, ``{schema_id: schema}`` for Confluent's; or ``"bytes"``,
    handed to the workflow as base64 text. The workflow gets the decoded value as its
    input or as the event's payload.
    """

    __slots__ = ("correlation", "event", "format", "schemas", "topic", "workflow")

    def __init__(
        self,
        topic: str,
        *,
        start: str | object | None = None,
        event: str | None = None,
        instance_id: str = "key",
        format: SourceFormat = "json",
        schemas: Sequence[AvroSchema] | Mapping[int, AvroSchema] = (),
    ) -> None:
        problem = name_problem(topic)
        if problem is not None or "/" in topic:
            raise ValueError(f"Source topic {topic!r}: {problem or 'must not contain /'}")
        if (start is None) == (event is None):
            raise ValueError(
                f"Source({topic!r}): give exactly one of start=<workflow> (each record "
                "starts an instance) or event=<name> (each record is sent as an event)"
            )
        workflow: str | None = None
        if start is not None:
            definition = definition_of(start)
            if definition is not None:
                workflow = definition.name
            elif isinstance(start, str) and start:
                workflow = start
            else:
                raise TypeError(
                    f"Source({topic!r}): start={start!r} is neither a workflow name nor "
                    "a function decorated with @workflow"
                )
        if event is not None:
            problem = event_name_problem(event)
            if problem is not None:
                raise ValueError(f"Source({topic!r}): event name {event!r} {problem}")
        if format not in FORMATS:
            raise ValueError(
                f"Source({topic!r}): format={format!r} is not one of {', '.join(FORMATS)}"
            )
        correlation = Correlation.parse(instance_id)
        if format == "bytes" and correlation.kind == "field":
            raise ValueError(
                f"Source({topic!r}): raw bytes have no fields; take the instance id from "
                "the key or a header"
            )
        if format == "avro" and not schemas:
            raise ValueError(
                f"Source({topic!r}): format='avro' needs the writer schemas: schemas=[...] "
                "for single-object records, schemas={id: schema} for Confluent's wire format"
            )
        if format != "avro" and schemas:
            raise ValueError(f"Source({topic!r}): schemas= is only for format='avro'")
        self.topic = topic
        self.workflow = workflow
        self.event = event
        self.correlation = correlation
        self.format: SourceFormat = format
        self.schemas: Mapping[int, AvroSchema] | tuple[AvroSchema, ...] = (
            dict(schemas) if isinstance(schemas, Mapping) else tuple(schemas)
        )

    @property
    def target(self) -> str:
        """What each record becomes, for messages: ``start order`` or ``event paid``."""
        return f"start {self.workflow}" if self.workflow is not None else f"event {self.event}"

    def __repr__(self) -> str:
        return (
            f"Source({self.topic!r}, {self.target}, instance_id={str(self.correlation)!r}, "
            f"format={self.format!r})"
        )


def sources_in(modules: Iterable[ModuleType]) -> list[Source]:
    """The ``Source`` objects at the top level of ``modules``, each once."""
    found: dict[int, Source] = {}
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, Source):
                found.setdefault(id(value), value)
    return list(found.values())


def declared_sources(registry: Registry) -> list[Source]:
    """The sources declared in the modules of the registry's workflows, checked: one
    source per topic, and a workflow to start that the registry has."""
    modules: dict[str, ModuleType] = {}
    for name, versions in registry.names().items():
        for version in versions:
            module_name = registry.resolve(name, version).fn.__module__
            module = sys.modules.get(module_name)
            if module is not None:
                modules[module_name] = module
    sources = sources_in(modules.values())
    by_topic: dict[str, Source] = {}
    for source in sources:
        other = by_topic.setdefault(source.topic, source)
        if other is not source:
            raise ValueError(
                f"two sources read topic {source.topic!r} ({other!r} and {source!r}); "
                "declare one Source per topic"
            )
        if source.workflow is not None:
            registry.resolve(source.workflow)  # UnknownWorkflow names what is registered
    return sources
