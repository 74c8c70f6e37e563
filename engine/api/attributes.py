"""Search attributes: the values ``ctx.set_attributes`` records on an instance, what
they may be, and how a listing's ``where`` compares them.

An attribute is a key (a name, without ``=``) and a scalar: text, a whole number, a
float or a bool. They are small by design (a listing reads them from every instance's
meta), so an instance holds at most ``MAX_ATTRIBUTES`` of them and text values are at
most ``MAX_TEXT_CHARS`` characters. ``None`` as a value removes the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

from stepstream.engine.wire.names import name_problem, text_problem, whole_number_problem

AttributeValue = str | int | float | bool
MAX_ATTRIBUTES = 64
MAX_TEXT_CHARS = 1024


def attribute_problem(key: object, value: object) -> str | None:
    """Why ``key``: ``value`` cannot be an attribute (None: removing the key), or None."""
    problem = name_problem(key)
    if problem is not None:
        return f"attribute key {key!r} {problem}"
    assert isinstance(key, str)
    if "=" in key:
        return (
            f"attribute key {key!r} contains '=', which separates key and value in `list --where`"
        )
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        problem = whole_number_problem(value)
        return None if problem is None else f"attribute {key!r} {problem}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"attribute {key!r} is {value}; give a finite number"
        return None
    if isinstance(value, str):
        if len(value) > MAX_TEXT_CHARS:
            return (
                f"attribute {key!r} is {len(value)} characters long; the limit is "
                f"{MAX_TEXT_CHARS} (keep the large value in the workflow's result)"
            )
        problem = text_problem(value)
        return None if problem is None else f"attribute {key!r} {problem}"
    return (
        f"attribute {key!r} is a {type(value).__name__}; give a str, int, float or bool "
        "(None removes it)"
    )


def plain(value: AttributeValue | None) -> AttributeValue | None:
    """The value as its built-in type: a subclass (``numpy.float64``, an ``IntEnum`` or
    ``StrEnum`` member) is stored, compared and shown as the number or text it is."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, int):  # not a bool: bool cannot be subclassed
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    assert isinstance(value, str)
    return str.__str__(value)


def merged(
    current: Mapping[str, AttributeValue], changes: Mapping[str, AttributeValue | None]
) -> dict[str, AttributeValue]:
    """``current`` with ``changes`` applied: a value sets its key, None removes it."""
    out = dict(current)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def same_value(stored: Any, wanted: Any) -> bool:
    """Whether a stored attribute equals the ``where`` value: text equals text, bool
    equals bool, and numbers compare as numbers (25 equals 25.0); 1 never equals True."""
    if isinstance(wanted, bool) or isinstance(stored, bool):
        return type(stored) is type(wanted) and stored == wanted
    if isinstance(wanted, int | float) and isinstance(stored, int | float):
        return bool(stored == wanted)  # exact, also between an int and a float
    return type(stored) is type(wanted) and bool(stored == wanted)


def parse_where(items: list[str]) -> dict[str, AttributeValue | list[AttributeValue]]:
    """``k=v`` pairs (the CLI's ``--where``) as a ``where`` mapping. A value that parses
    as a JSON number, ``true`` or ``false`` matches that value or the same text (``42``
    finds ``"42"`` and ``42``), a JSON string only that string (``'"42"'``); anything
    else is the text as typed. ``ValueError`` saying what is wrong."""
    out: dict[str, AttributeValue | list[AttributeValue]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--where {item!r} is not KEY=VALUE (for example customer=42)")
        if key in out:
            raise ValueError(
                f"--where gives {key!r} twice; every --where must match and an attribute has "
                "one value: give each key once"
            )
        value: Any
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError:
            value = text
        if not isinstance(value, str | int | float | bool):
            value = text  # null, a list or an object: the text as typed
        out[key] = value if isinstance(value, str) else [value, text]
    return out
