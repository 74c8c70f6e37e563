"""Conversion between record objects and the dicts fastavro reads and writes, for record
types or versions the compiled plans do not cover: older writer versions, resolved
against the latest, and everything when the serde is built with ``compiled=False``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from stepstream.engine.wire.avro.field_map import Field, nested
from stepstream.engine.wire.avro.schema_files import Schema

_Convert = Callable[[Any], Any]


def _converters(schema: Schema, t: Any) -> tuple[_Convert | None, _Convert | None]:
    """(to fastavro, from fastavro) for values of type ``t``; None where values pass as is."""
    t = schema.resolve(t)
    if isinstance(t, list):
        pairs = [(b, _converters(schema, b)) for b in t]
        converted = [(b, conv) for b, conv in pairs if conv != (None, None)]
        if not converted:
            return None, None
        if len(converted) > 1:
            raise ValueError(f"{schema.file.path}: unions of several records are unsupported")
        branch, (to, back) = converted[0]
        cls = nested(schema, schema.resolve(branch))[0]
        assert to is not None and back is not None
        return (
            lambda v: to(v) if isinstance(v, cls) else v,
            lambda v: back(v) if isinstance(v, dict) else v,
        )
    if isinstance(t, dict) and t.get("type") == "record":
        cls, plan = nested(schema, t)
        to_dict, from_dict = dict_converters(schema, plan)
        return to_dict, lambda d: cls(**from_dict(d))
    if isinstance(t, dict) and t.get("type") in ("array", "map"):
        inner = _converters(schema, t.get("items", t.get("values")))
        if inner != (None, None):
            raise ValueError(f"{schema.file.path}: records inside {t['type']}s are unsupported")
    return None, None


def dict_converters(
    schema: Schema, plan: list[Field]
) -> tuple[Callable[[Any], dict[str, Any]], Callable[[Mapping[str, Any]], dict[str, Any]]]:
    """(object -> fastavro dict, fastavro dict -> constructor keywords) for a record plan."""
    out: list[tuple[str, str | None, Any, _Convert | None, Any]] = []
    back: list[tuple[str, str, _Convert | None]] = []
    inline: list[tuple[str, Callable[[Any], dict[str, Any]]]] = []
    inline_back: list[tuple[str, Callable[[Mapping[str, Any]], dict[str, Any]]]] = []
    for f in plan:
        if f.inline:
            to_inner, from_inner = dict_converters(schema, list(f.inline))
            inline.append((f.name, to_inner))
            inline_back.append((f.name, from_inner))
            continue
        to, frm = _converters(schema, f.type)
        out.append((f.name, f.attr, f.default, to, None))
        if f.attr is not None:
            back.append((f.name, f.attr, frm))

    def to_dict(obj: Any) -> dict[str, Any]:
        d: dict[str, Any] = {name: conv(obj) for name, conv in inline}
        for name, attr, default, to, _ in out:
            if attr is None:
                d[name] = default
            else:
                value = getattr(obj, attr)
                d[name] = value if to is None else to(value)
        return d

    def from_dict(d: Mapping[str, Any]) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        for name, conv in inline_back:
            kw.update(conv(d[name]))
        for name, attr, frm in back:
            value = d[name]
            kw[attr] = value if frm is None else frm(value)
        return kw

    return to_dict, from_dict
