"""The map from record classes onto their schemas: for each Avro field, the attribute it
maps to, or the default written for a field the class lacks. The envelope field
``header`` is flattened: its fields are attributes of the record itself. A class
attribute with no field in the schema is refused, since it would be lost.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from stepstream.engine.wire.avro.schema_files import Schema
from stepstream.engine.wire.records import Payload, Record

_HEADER: Final = "header"
_ENVELOPE_ATTRS: Final = frozenset(f.name for f in fields(Record))
# Records nested inside record types, by Avro name; the envelope is flattened instead.
_NESTED_CLASSES: Final[Mapping[str, type[Any]]] = {"Payload": Payload}
_NO_DEFAULT: Final = object()


@dataclass(frozen=True, slots=True)
class Field:
    """One Avro field and the attribute it maps to. ``attr`` None: the class has no such
    attribute (written as ``default``, dropped when read). ``inline``: the envelope, a
    record whose fields are attributes of the outer object itself."""

    name: str
    attr: str | None
    type: Any
    default: Any = _NO_DEFAULT
    inline: tuple[Field, ...] = ()


def flat(plan: Iterable[Field]) -> Iterator[Field]:
    for f in plan:
        if f.inline:
            yield from f.inline
        else:
            yield f


def _default_value(schema: Schema, t: Any, default: Any) -> Any:
    """The Python value of an Avro JSON default (a union's default is of its first branch)."""
    t = schema.resolve(t)
    if isinstance(t, list):
        return _default_value(schema, t[0], default)
    if t == "bytes" or (isinstance(t, dict) and t.get("type") in ("bytes", "fixed")):
        return str(default).encode("latin-1")
    if isinstance(t, dict) and t.get("type") in ("record", "error", "array", "map"):
        raise ValueError(f"{schema.file.path}: defaults of type {t.get('type')} are unsupported")
    return default


def _map_record(
    schema: Schema, record: Mapping[str, Any], attrs: Collection[str], owner: str
) -> list[Field]:
    plan = []
    for f in record["fields"]:
        name: str = f["name"]
        if name in attrs:
            plan.append(Field(name, name, f["type"]))
        elif "default" in f:
            plan.append(
                Field(name, None, f["type"], _default_value(schema, f["type"], f["default"]))
            )
        else:
            raise ValueError(
                f"{schema.file.path}: field {name!r} has no default and {owner} has no such "
                "attribute, so it cannot be written with this schema"
            )
    return plan


def _check_covered(schema: Schema, plan: list[Field], cls: type[Any]) -> None:
    covered = {f.attr for f in flat(plan)}
    missing = [f.name for f in fields(cls) if f.init and f.name not in covered]
    if missing:
        raise ValueError(
            f"{schema.file.path}: {cls.type_name} attributes {missing} have no field in the "
            "schema and would be lost; add them to a new schema version"
        )


def record_plan(schema: Schema, cls: type[Record]) -> list[Field]:
    own = {f.name for f in fields(cls)} - _ENVELOPE_ATTRS
    plan: list[Field] = []
    for f in schema.schema["fields"]:
        if f["name"] == _HEADER:
            envelope = schema.resolve(f["type"])
            if not isinstance(envelope, dict) or envelope.get("type") != "record":
                raise ValueError(f"{schema.file.path}: field 'header' must be the envelope record")
            inline = _map_record(schema, envelope, _ENVELOPE_ATTRS, cls.__name__)
            plan.append(Field(_HEADER, None, f["type"], inline=tuple(inline)))
        else:
            plan.extend(_map_record(schema, {"fields": [f]}, own, cls.__name__))
    _check_covered(schema, plan, cls)
    return plan


def nested(schema: Schema, record: Mapping[str, Any]) -> tuple[type[Any], list[Field]]:
    name = record["name"].rpartition(".")[2]
    cls = _NESTED_CLASSES.get(name)
    if cls is None:
        raise ValueError(f"{schema.file.path}: no Python class for nested record {name!r}")
    plan = _map_record(schema, record, [f.name for f in fields(cls)], cls.__name__)
    _check_covered(schema, plan, cls)
    return cls, plan
